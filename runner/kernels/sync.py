"""What the threads of a parallel region share beyond numba's prange: how many they are, and
counters they change atomically (kernels/team.py's steps)."""
import platform

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic
def threads(typingctx):
    """The threads a parallel region started here runs on (numba.get_num_threads, this thread's
    setting): its threading layer's own function, by name, as numba's parallel loops call it (the
    function numba offers njit code is a pointer, which keeps a kernel from its disk cache)."""
    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []), "get_num_threads")
        return builder.call(fn, [])
    return types.int64(), codegen


def _at(context, builder, sig, args):
    return builder.gep(context.make_array(sig.args[0])(context, builder, args[0]).data, [args[1]])


@intrinsic
def fetch_add(typingctx, arr, i):
    """arr[i] += 1 as one atomic step (int64, sequentially consistent) -> the value before."""
    def codegen(context, builder, sig, args):
        return builder.atomic_rmw("add", _at(context, builder, sig, args), ir.Constant(ir.IntType(64), 1), "seq_cst")
    return types.int64(arr, i), codegen


@intrinsic
def load_acquire(typingctx, arr, i):
    """arr[i] (int64), seeing every write its writer made before releasing it."""
    def codegen(context, builder, sig, args):
        return builder.load_atomic(_at(context, builder, sig, args), "acquire", 8)
    return types.int64(arr, i), codegen


@intrinsic
def store_release(typingctx, arr, i):
    """arr[i] = 1 (int64), after every write before it."""
    def codegen(context, builder, sig, args):
        builder.store_atomic(ir.Constant(ir.IntType(64), 1), _at(context, builder, sig, args), "release", 8)
        return context.get_dummy_value()
    return types.void(arr, i), codegen


@intrinsic
def pause(typingctx):
    """A spin-wait hint (x86's pause: the waiting core yields to its sibling and saves power)."""
    def codegen(context, builder, sig, args):
        if platform.machine().lower() in ("x86_64", "amd64", "i686"):
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()
    return types.void(), codegen
