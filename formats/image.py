"""Images as the vision towers take them: a file's bytes decoded to RGB pixels, within bounds.

Pillow decodes (PNG, JPEG, WebP, GIF, BMP, TIFF and the rest it knows): a kept library made for
the job, its decoders fuzzed upstream. What a client sends is bounded before a pixel is decoded,
since a small file may hold a huge image (a PNG of zeros compresses a thousandfold): at most
MAX_BYTES read, MAX_SIDE pixels a side and MAX_PIXELS in all, as the header says; a file that is
not an image, is cut short or is damaged is one ImageError line, never a decoder's traceback.

The pixels are those transformers' image processors start from (image_transforms.convert_to_rgb):
an animation's first frame; transparency laid over white; 16-bit samples scaled to 8 bits.
"""
from __future__ import annotations

import hashlib
import io
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from .errors import NibbleError

MAX_BYTES = 64 * 2**20      # a file read whole: more than a 48-megapixel phone photo's JPEG
MAX_SIDE = 16384            # pixels a side: a tower resizes or tiles anything past ~2048 anyway
MAX_PIXELS = 64 * 2**20     # in all: a 16384 x 4096 strip, 192 MB decoded as RGB


class ImageError(NibbleError):
    """Bytes that are not an image nibble reads, or one past its bounds."""


@dataclass(frozen=True, eq=False)
class Picture:
    """An image in a prompt: its pixels, what to call it, the file it came from (kept with a chat),
    and the hash of its pixels (hex), by which a model keeps what it made of them."""
    pixels: np.ndarray   # uint8 [height, width, 3], RGB
    name: str
    data: bytes          # the file's bytes
    digest: str

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) in pixels."""
        return self.pixels.shape[1], self.pixels.shape[0]

    @property
    def nbytes(self) -> int:
        return len(self.data)

    def describe(self) -> str:
        """What a person is shown of it: its name, size in pixels and file size."""
        kb = self.nbytes / 1024
        file_size = f"{kb:.0f} KB" if kb < 1024 else f"{kb / 1024:.1f} MB"
        return f"{Path(self.name).name} ({self.size[0]} x {self.size[1]}, {file_size})"


def open_image(source: bytes | str | Path, name: str | None = None) -> Picture:
    """read_image's pixels as a Picture: the same pixels, whatever file holds them, have one digest."""
    if isinstance(source, (str, Path)):
        name = name or str(source)
        source = _read_file(Path(source), name)
    pixels = read_image(source, name)
    digest = hashlib.blake2b(repr(pixels.shape).encode() + pixels.tobytes(), digest_size=16).hexdigest()
    return Picture(pixels, name or "the image", bytes(source), digest)


def read_image(source: bytes | str | Path, name: str | None = None) -> np.ndarray:
    """The pixels of an image file (its path) or of its bytes: uint8 [height, width, 3], RGB.
    `name` says which image in a message (default: the path, or "the image")."""
    if isinstance(source, (str, Path)):
        name = name or str(source)
        data = _read_file(Path(source), name)
    else:
        name, data = name or "the image", bytes(source)
    if len(data) > MAX_BYTES:
        raise ImageError(f"{name} is {len(data) / 2**20:.0f} MB: images of at most {MAX_BYTES // 2**20} MB are read")
    try:
        with warnings.catch_warnings():   # a damaged file's notes (corrupt EXIF, say) are not the user's
            warnings.simplefilter("ignore")
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            _check_size(image.size, name)
            image.seek(0)   # an animation's first frame
            image.load()
            return _rgb(image)
    except ImageError:
        raise
    except UnidentifiedImageError:
        raise ImageError(f"{name} is not an image nibble can read (PNG, JPEG, WebP, GIF, BMP or TIFF)") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):   # Pillow's own bound, past ours
        raise ImageError(f"{name} is more than {MAX_PIXELS // 2**20} megapixels: images of at most "
                         f"{MAX_SIDE} pixels a side and {MAX_PIXELS // 2**20} megapixels in all are read") from None
    except MemoryError:
        raise ImageError(f"{name} is too large to decode") from None
    except (OSError, SyntaxError, ValueError, TypeError, IndexError, KeyError, EOFError, struct.error) as e:
        # what Pillow's decoders raise on a file cut short or damaged (SyntaxError: PNG's chunks)
        what = "cut short" if "truncated" in str(e) else "damaged"
        raise ImageError(f"{name} is {what} and cannot be decoded ({type(e).__name__}: {e})") from None


def _read_file(path: Path, name: str) -> bytes:
    if path.is_dir():
        raise ImageError(f"{name} is a folder, not an image file")
    try:
        size = path.stat().st_size
        if size > MAX_BYTES:
            raise ImageError(f"{name} is {size / 2**20:.0f} MB: images of at most {MAX_BYTES // 2**20} MB are read")
        return path.read_bytes()
    except FileNotFoundError:
        raise ImageError(f"{name}: no such file") from None
    except OSError as e:
        raise ImageError(f"{name} cannot be read: {e.strerror or e}") from None


def _check_size(size: tuple[int, int], name: str):
    width, height = size
    if width < 1 or height < 1:
        raise ImageError(f"{name} has no pixels ({width} x {height})")
    if max(width, height) > MAX_SIDE or width * height > MAX_PIXELS:
        raise ImageError(f"{name} is {width} x {height} pixels: images of at most {MAX_SIDE} pixels a side "
                         f"and {MAX_PIXELS // 2**20} megapixels in all are read")


def _rgb(image: Image.Image) -> np.ndarray:
    """uint8 [H, W, 3]: as transformers' convert_to_rgb gives it, 16-bit and float samples first
    brought to 8 bits."""
    if image.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        a = np.asarray(image, np.float64)
        if image.mode.startswith("I;16") or (image.mode == "I" and a.max(initial=0) > 255):
            a = a / 257   # 0..65535 onto 0..255
        image = Image.fromarray(np.clip(np.rint(a), 0, 255).astype(np.uint8), "L")
    if image.mode != "RGB":
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        image = Image.alpha_composite(white, rgba).convert("RGB")
    return np.asarray(image, np.uint8).copy()
