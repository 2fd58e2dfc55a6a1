"""Compiling a kernel, made cheaper: two of numba's IR passes that spent most of a first run's
compile time copying the same data again (about half of a kernel's first compile).
- Inlining a function copies its IR block by block, each block with a deep copy of its own:
  every copy of a block copies the whole scope again (all the function's variables), a cost
  that grows with the function's size squared. The blocks of one function are copied here with
  one memo (one for each scope: inlining copies a function, then that copy), so they share one
  copy of the scope, as the blocks they copy share one.
- Copy propagation iterates its data-flow equations to a fixed point, deep-copying every block's
  set of copies each round to see whether anything changed (the sets hold tuples of names:
  comparing the new sets with the old is the same test), and rebuilt a block's assigned names
  once for every copy in the function.
The results are the same IR. They replace numba internals, so they are installed only on the
numba they follow (TESTED): another numba compiles as it always does, slower. They are installed
at a process's first compile: a run that only loads cached kernels does not import them.
"""
import contextvars
import copy
from types import SimpleNamespace

import numba
from numba.core import event

TESTED = "0.68."
_memo = contextvars.ContextVar("inline_memo", default=None)


def install():
    if numba.__version__.startswith(TESTED):
        event.register("numba:compile", AtFirstCompile(_install))


class AtFirstCompile(event.Listener):
    """Calls `install` once, when this process's first compile starts: a run that only loads
    cached kernels never does."""

    def __init__(self, install):
        self.install = install
        self.done = False   # stays registered: unregistering while numba notifies would skip a listener

    def on_start(self, ev):
        if not self.done:
            self.done = True
            self.install()

    def on_end(self, ev):
        pass


def _install():
    global _numba_inline_ir, numba_copy_propagate, ir_utils, compute_cfg_from_blocks
    from numba.core import inline_closurecall, ir_utils
    from numba.core.analysis import compute_cfg_from_blocks
    from numba.parfors import parfor
    if inline_closurecall.InlineWorker.inline_ir is _inline_ir:
        return
    _numba_inline_ir = inline_closurecall.InlineWorker.inline_ir
    numba_copy_propagate = ir_utils.copy_propagate
    inline_closurecall.InlineWorker.inline_ir = _inline_ir
    inline_closurecall.copy = SimpleNamespace(deepcopy=_deepcopy)   # its only use: copying blocks
    ir_utils.copy_propagate = parfor.copy_propagate = _copy_propagate


def _inline_ir(self, *args, **kwargs):
    """numba's InlineWorker.inline_ir, the blocks of each function it copies copied with one memo."""
    token = _memo.set({})   # id(scope) -> memo
    try:
        return _numba_inline_ir(self, *args, **kwargs)
    finally:
        _memo.reset(token)


def _deepcopy(block, memo=None):
    memos = _memo.get()
    if memo is None and memos is not None:
        memo = memos.setdefault(id(block.scope), {})
    return copy.deepcopy(block, memo)


def _copy_propagate(blocks, typemap):
    """numba's ir_utils.copy_propagate: the copies that reach each block's start and end."""
    cfg = compute_cfg_from_blocks(blocks)
    entry = cfg.entry_point()
    gen_copies, kill_copies, in_copies, out_copies = _init_copy_propagate_data(blocks, entry, typemap)
    changed = True
    while changed:
        changed = False
        for label in blocks.keys():
            if label == entry:
                continue
            predecs = [i for i, _d in cfg.predecessors(label)]
            in_copies[label] = out_copies[predecs[0]].copy()
            for p in predecs:
                in_copies[label] &= out_copies[p]
            out = gen_copies[label] | (in_copies[label] - kill_copies[label])
            changed = changed or out != out_copies[label]
            out_copies[label] = out
    return in_copies, out_copies


def _init_copy_propagate_data(blocks, entry, typemap):
    """numba's ir_utils.init_copy_propagate_data (less all_copies), a block's assigned names
    found once."""
    gen_copies, extra_kill = ir_utils.get_block_copies(blocks, typemap)
    all_copies = set().union(*gen_copies.values())
    kill_copies = {}
    for label, gen_set in gen_copies.items():
        extra, assigned = extra_kill[label], {lhs for lhs, rhs in gen_set}
        kill_copies[label] = {(lhs, rhs) for lhs, rhs in all_copies
                              if lhs in extra or rhs in extra
                              or ((lhs, rhs) not in gen_set and (lhs in assigned or rhs in assigned))}
    in_copies = {label: all_copies.copy() for label in blocks.keys()}
    in_copies[entry] = set()
    out_copies = {label: gen_copies[label] | (in_copies[label] - kill_copies[label]) for label in blocks.keys()}
    out_copies[entry] = gen_copies[entry]
    return gen_copies, kill_copies, in_copies, out_copies
