"""formats/image.py: images decoded to the RGB pixels transformers' processors start from, and
every hostile file (not an image, cut short, damaged, a decompression bomb, too wide, too big)
one line of ImageError; fuzzed with bytes mutated from valid files."""
import io
import struct
import zlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

from nibble.formats import image as image_module
from nibble.formats.image import MAX_SIDE, ImageError, read_image

rng = np.random.default_rng(0)
PIXELS = rng.integers(0, 256, (5, 7, 3), dtype=np.uint8)


def encoded(img: Image.Image, fmt: str, **kw) -> bytes:
    out = io.BytesIO()
    img.save(out, fmt, **kw)
    return out.getvalue()


@pytest.mark.parametrize("fmt", ["PNG", "BMP", "TIFF", "WEBP"])
def test_lossless_files_give_their_pixels(fmt):
    kw = {"lossless": True} if fmt == "WEBP" else {}
    got = read_image(encoded(Image.fromarray(PIXELS), fmt, **kw))
    assert got.dtype == np.uint8 and got.shape == (5, 7, 3)
    np.testing.assert_array_equal(got, PIXELS)


def test_a_jpeg_decodes_near_its_pixels_and_a_path_reads_as_its_bytes(tmp_path):
    smooth = np.repeat(np.linspace(0, 255, 64, dtype=np.uint8)[None, :, None], 32, 0).repeat(3, 2)
    path = tmp_path / "photo.jpg"
    path.write_bytes(encoded(Image.fromarray(smooth), "JPEG", quality=95))
    got = read_image(path)
    assert got.shape == (32, 64, 3) and np.abs(got.astype(int) - smooth).max() <= 8
    np.testing.assert_array_equal(got, read_image(path.read_bytes()))


def test_transparency_is_laid_over_white_and_gray_becomes_rgb():
    rgba = np.zeros((2, 2, 4), np.uint8)
    rgba[0, 0] = (255, 0, 0, 255)     # opaque red
    rgba[0, 1] = (0, 0, 255, 0)       # transparent: white
    rgba[1, 0] = (0, 0, 0, 128)       # half black over white
    got = read_image(encoded(Image.fromarray(rgba, "RGBA"), "PNG"))
    assert got[0, 0].tolist() == [255, 0, 0] and got[0, 1].tolist() == [255, 255, 255]
    assert abs(int(got[1, 0, 0]) - 127) <= 1
    gray = read_image(encoded(Image.fromarray(PIXELS[..., 0], "L"), "PNG"))
    np.testing.assert_array_equal(gray, np.repeat(PIXELS[..., :1], 3, 2))


def test_16_bit_samples_are_scaled_to_8_bits():
    wide = np.array([[0, 257 * 100, 65535]], np.uint16)
    got = read_image(encoded(Image.fromarray(wide), "PNG"))   # mode I;16
    assert got[0, :, 0].tolist() == [0, 100, 255] and (got[..., 0] == got[..., 2]).all()


def test_an_animation_gives_its_first_frame():
    frames = [Image.fromarray(np.full((4, 4, 3), v, np.uint8)) for v in (10, 200)]
    out = io.BytesIO()
    frames[0].save(out, "GIF", save_all=True, append_images=frames[1:])
    assert (read_image(out.getvalue()) == 10).all()


def png(width: int, height: int, body: bytes = b"") -> bytes:
    """A PNG whose header says width x height (8-bit gray), with `body` as its compressed rows."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", body) + chunk(b"IEND", b""))


@pytest.mark.parametrize("data,message", [
    pytest.param(b"", "is not an image nibble can read", id="empty"),
    pytest.param(b"hello, world" * 10, "is not an image nibble can read", id="text"),
    pytest.param(b'{"messages": []}', "is not an image nibble can read", id="json"),
    pytest.param(png(40000, 10), f"is 40000 x 10 pixels: images of at most {MAX_SIDE} pixels a side", id="wide"),
    # decompression bombs: a header of 4096 x 16384 pixels, and one past Pillow's own bound
    pytest.param(png(16384, 4097), "is 16384 x 4097 pixels", id="bomb"),
    pytest.param(png(16384, 16384, zlib.compress(b"\0" * (16385 * 64), 9)), "is more than 64 megapixels",
                 id="pillow's bomb"),
    pytest.param(png(8, 8, zlib.compress(b"\0" * 20)), "is cut short and cannot be decoded", id="cut short"),
    pytest.param(png(8, 8, b"not deflate at all"), "is damaged and cannot be decoded", id="damaged"),
])
def test_hostile_files_are_one_line_of_image_error(data, message):
    with pytest.raises(ImageError) as e:
        read_image(data, "upload.png")
    assert str(e.value).startswith("upload.png ") and message in str(e.value) and "\n" not in str(e.value)


def test_a_file_cut_short_and_a_file_too_big_are_refused(tmp_path, monkeypatch):
    whole = encoded(Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)), "JPEG")
    with pytest.raises(ImageError, match="the image is cut short"):
        read_image(whole[:len(whole) // 2])
    monkeypatch.setattr(image_module, "MAX_BYTES", 1000)
    path = tmp_path / "big.jpg"
    path.write_bytes(whole)
    with pytest.raises(ImageError, match=r"big.jpg is 0 MB: images of at most 0 MB"):
        read_image(path)
    with pytest.raises(ImageError, match="nowhere.png: no such file"):
        read_image(tmp_path / "nowhere.png")
    with pytest.raises(ImageError, match="is a folder, not an image file"):
        read_image(tmp_path)


VALID = [encoded(Image.fromarray(PIXELS), fmt) for fmt in ("PNG", "JPEG", "GIF", "BMP", "WEBP", "TIFF")]


@pytest.mark.fuzz
@given(st.sampled_from(VALID), st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=8),
       st.integers(0, 10**6) | st.none())
def test_mutated_files_give_pixels_or_one_line_of_image_error(data, flips, cut):
    """Bytes flipped and files cut short: each ends in RGB pixels or ImageError, never another
    exception."""
    data = bytearray(data)
    for at, value in flips:
        data[at % len(data)] = value
    if cut is not None:
        del data[cut % (len(data) + 1):]
    try:
        got = read_image(bytes(data))
    except ImageError as e:
        assert "\n" not in str(e)
    else:
        assert got.dtype == np.uint8 and got.ndim == 3 and got.shape[2] == 3
