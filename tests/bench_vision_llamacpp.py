"""Time llama.cpp's vision encoder (libmtmd) on one image, the figure nibble's tower is compared
with: a text GGUF and its mmproj GGUF loaded through libmtmd's C API, a prompt holding one image
tokenized (which preprocesses the image: resized as the model wants it, scaled by mean and std),
and `mtmd_encode_chunk` of the image's chunks (the tower and the projector) timed over repeats:
Gemma 3's one, SmolVLM's one a tile and one for the whole image (libmtmd cuts them as Idefics3's
processor does: a 512 x 512 image made 2048 x 2048, 4 x 4 tiles of 512 and the whole, 17). Prints
JSON: the median seconds of all the chunks, every repeat, the chunks, the median per chunk, the
image's tokens (256 for Gemma 3, 17 x 64 for SmolVLM at 512).

A script, not a test (pytest collects test_*.py only); it runs in llama-cpp-python's environment
(0.3.36, with its lib/libmtmd.so), not nibble's:

    ~/.cache/nibble-ref/llcpp/bin/python tests/bench_vision_llamacpp.py \\
        --model ~/.cache/nibble-ref/vision/gemma3-real/model-f32.gguf \\
        --mmproj ~/.cache/nibble-ref/vision/gemma3-real/mmproj-f16.gguf \\
        --image ~/.cache/nibble-ref/vision/gemma3-real/image-896.png --threads 2 --repeats 5
    ~/.cache/nibble-ref/llcpp/bin/python tests/bench_vision_llamacpp.py \\
        --model ~/.cache/nibble-ref/vision/smolvlm-real/model-f32.gguf \\
        --mmproj ~/.cache/nibble-ref/vision/smolvlm-real/mmproj-f16.gguf \\
        --image ~/.cache/nibble-ref/vision/smolvlm-real/image-512.png --threads 2 --repeats 5

`--pixels FILE.npy` gives the image as transformers' processor made it ([3, H, W] in [-1, 1]
with mean and std 0.5, tests/data/vision/gemma3/pixel_values.npy) instead of a file: its bytes
are recovered exactly and handed over at the tower's size, so that llama.cpp's own resize (which
keeps the aspect ratio and pads with black, where transformers stretches) does not run and the
towers see the same pixels. `--embd-out FILE.npy` writes what llama.cpp computed, [tokens, text
hidden] float32; `--expect FILE.npy` prints its largest difference from another's
(tests/data/vision/gemma3/features.npy: transformers' image tokens of those pixels).
"""
import argparse
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import llama_cpp
from llama_cpp import mtmd_cpp as mtmd


FLASH_ATTN = {"auto": llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO, "on": llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
              "off": llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED}


def quiet_logs():
    """llama.cpp and libmtmd log every tensor they load to stderr: keep only warnings and errors
    (ggml.h's levels: 3 and 4, 5 continuing the line before)."""
    shown = [False]

    @llama_cpp.llama_log_callback
    def log(level, text, user_data):
        shown[0] = level in (3, 4) or (level == 5 and shown[0])
        if shown[0]:
            sys.stderr.write(text.decode("utf-8", "replace"))
    llama_cpp.llama_log_set(log, ctypes.c_void_p(0))
    mtmd.mtmd_log_set(log, ctypes.c_void_p(0))
    mtmd.mtmd_helper_log_set(log, ctypes.c_void_p(0))
    return log   # kept alive by the caller: libmtmd calls it later


def bitmap_of(ctx, args):
    if args.pixels:
        pixels = np.load(args.pixels).astype(np.float64)   # [3, H, W], (x / 255 - 0.5) / 0.5
        rgb = np.rint((pixels * 0.5 + 0.5) * 255)
        if np.abs(rgb - (pixels * 0.5 + 0.5) * 255).max() > 1e-3:
            raise SystemExit(f"{args.pixels}: not bytes scaled by mean and std 0.5")
        rgb = np.ascontiguousarray(rgb.clip(0, 255).astype(np.uint8).transpose(1, 2, 0))
        height, width, _ = rgb.shape
        return mtmd.mtmd_bitmap_init(width, height, rgb.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)))
    data = Path(args.image).read_bytes()
    buf = (ctypes.c_uint8 * len(data)).from_buffer(bytearray(data))
    return mtmd.mtmd_helper_bitmap_init_from_buf(ctx, buf, len(data), False)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the text model's GGUF")
    p.add_argument("--mmproj", required=True, help="the vision tower and projector's GGUF")
    image = p.add_mutually_exclusive_group(required=True)
    image.add_argument("--image", help="an image file (PNG, JPEG: what stb_image reads)")
    image.add_argument("--pixels", help="[3, H, W] pixels as transformers' Gemma 3 processor makes them (.npy)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--flash-attn", choices=FLASH_ATTN, default="auto",
                   help="the tower's attention: libmtmd's default, auto, takes flash attention on the CPU")
    p.add_argument("--prompt", default="Describe this image: <__media__>",
                   help="the text around the image; <__media__> marks where it goes")
    p.add_argument("--embd-out", help="write the image's embeddings here (.npy)")
    p.add_argument("--expect", help="an .npy of the same embeddings to compare with")
    p.add_argument("--verbose", action="store_true", help="llama.cpp's and libmtmd's logs")
    args = p.parse_args(argv)

    keep = None if args.verbose else quiet_logs()
    llama_cpp.llama_backend_init()
    model_params = llama_cpp.llama_model_default_params()
    model_params.n_gpu_layers = 0
    model = llama_cpp.llama_model_load_from_file(str(args.model).encode(), model_params)
    if not model:
        raise SystemExit(f"{args.model}: llama.cpp could not load it")
    params = mtmd.mtmd_context_params_default()
    params.use_gpu = False
    params.print_timings = False
    params.n_threads = args.threads   # the thread count of the tower's ggml graph (default 4)
    params.warmup = True              # one encode at load, of a placeholder image: not timed
    params.flash_attn_type = FLASH_ATTN[args.flash_attn]
    t = time.perf_counter()
    ctx = mtmd.mtmd_init_from_file(str(args.mmproj).encode(), model, params)
    load_s = time.perf_counter() - t
    if not ctx:
        raise SystemExit(f"{args.mmproj}: libmtmd could not load it")

    bitmap = bitmap_of(ctx, args)
    if not bitmap:
        raise SystemExit("libmtmd could not read the image")
    text = mtmd.mtmd_input_text()
    prompt = args.prompt.encode()
    text.text, text.text_len, text.add_special, text.parse_special = prompt, len(prompt), True, True
    chunks = mtmd.mtmd_input_chunks_init()
    bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
    t = time.perf_counter()
    rc = mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(text), bitmaps, 1)
    tokenize_s = time.perf_counter() - t   # the image's resize and normalization, and the text's
    if rc != 0:
        raise SystemExit(f"mtmd_tokenize: {rc}")
    layout, image_chunks = [], []
    for i in range(mtmd.mtmd_input_chunks_size(chunks)):
        chunk = mtmd.mtmd_input_chunks_get(chunks, i)
        kind = mtmd.mtmd_input_chunk_get_type(chunk)
        if kind == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
            n = ctypes.c_size_t()
            ids = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
            layout.append([ids[j] for j in range(n.value)])
        elif kind == mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE:
            image_chunks.append(chunk)
            layout.append(f"image: {mtmd.mtmd_input_chunk_get_n_tokens(chunk)} tokens")
    if not image_chunks:
        raise SystemExit(f"no image in the prompt's chunks: {layout}")
    counts = [mtmd.mtmd_input_chunk_get_n_tokens(c) for c in image_chunks]
    tokens = mtmd.mtmd_input_chunk_get_tokens_image(image_chunks[0])
    grid = [mtmd.mtmd_image_tokens_get_nx(tokens), mtmd.mtmd_image_tokens_get_ny(tokens)]

    # a repeat encodes every image chunk (SmolVLM's: a chunk a tile, the whole image's last)
    seconds, width, embd = [], llama_cpp.llama_model_n_embd(model), []
    for repeat in range(args.repeats):
        t = time.perf_counter()
        for chunk, n_tokens in zip(image_chunks, counts):
            rc = mtmd.mtmd_encode_chunk(ctx, chunk)
            if rc != 0:
                raise SystemExit(f"mtmd_encode_chunk: {rc}")
            if repeat == args.repeats - 1:   # untimed: the output is the last chunk's
                pause = time.perf_counter()
                embd.append(np.ctypeslib.as_array(mtmd.mtmd_get_output_embd(ctx), shape=(n_tokens, width)).copy())
                t += time.perf_counter() - pause
        seconds.append(time.perf_counter() - t)
    embd = np.concatenate(embd)
    n_tokens = len(embd)
    result = {"median_s": round(statistics.median(seconds), 4), "seconds": [round(s, 4) for s in seconds],
              "image_chunks": len(image_chunks),
              "median_per_chunk_s": round(statistics.median(seconds) / len(image_chunks), 4),
              "image_tokens": n_tokens, "grid": grid, "threads": args.threads, "flash_attn": args.flash_attn,
              "load_s": round(load_s, 3),
              "tokenize_s": round(tokenize_s, 4), "chunks": layout,
              "mmproj": str(args.mmproj), "llama_cpp_python": llama_cpp.__version__,
              "embd_rms": float(np.sqrt(np.mean(embd.astype(np.float64) ** 2)))}
    if args.embd_out:
        np.save(args.embd_out, embd.astype(np.float32))
        result["embd_out"] = str(args.embd_out)
    if args.expect:
        want = np.load(args.expect).reshape(embd.shape)
        result["max_abs_diff"] = float(np.abs(embd - want).max())
        result["expect_max_abs"] = float(np.abs(want).max())
    print(json.dumps(result))

    mtmd.mtmd_input_chunks_free(chunks)
    mtmd.mtmd_bitmap_free(bitmap)
    mtmd.mtmd_free(ctx)
    llama_cpp.llama_model_free(model)
    del keep


if __name__ == "__main__":
    main()
