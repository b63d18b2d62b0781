"""A line plot to PNG with numpy and zlib alone (no plotting library on the CPU default).

`plot_metric(metrics.jsonl, "reward_mean", out.png)` draws the series against the trainer step,
with axes, ticks labelled in a built-in 3x5 pixel font, and a moving average.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import numpy as np

_FONT = {  # 3x5 glyphs, rows top to bottom, 3 bits each
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111",
    "3": "111001111001111", "4": "101101111001001", "5": "111100111001111",
    "6": "111100111101111", "7": "111001010010010", "8": "111101111101111",
    "9": "111101111001111", ".": "000000000000010", "-": "000000111000000",
    "a": "000011101101011", "b": "100111101101111", "d": "001111101101111",
    "e": "000111111100111", "m": "000111111101101", "n": "000110101101101",
    "p": "000111101111100", "r": "000111100100100", "s": "000011110001110",
    "t": "010111010010011", "w": "000101101111111", "_": "000000000000111",
    " ": "000000000000000", "o": "000111101101111", "l": "110010010010111",
    "v": "000101101101010", "i": "010000010010010", "g": "000111101111001",
    "c": "000111100100111", "u": "000101101101111", "h": "100111101101101",
    "k": "100101110101101", "f": "011010111010010", "x": "000101010010101",
    "y": "000101111001111", "z": "000111010100111", "q": "000111101111001",
}


def _text(img: np.ndarray, x: int, y: int, s: str, color: tuple[int, int, int], scale: int = 2) -> None:
    for ch in s.lower():
        glyph = _FONT.get(ch, _FONT[" "])
        for i, bit in enumerate(glyph):
            if bit == "1":
                r, c = divmod(i, 3)
                img[y + r * scale: y + (r + 1) * scale, x + c * scale: x + (c + 1) * scale] = color
        x += 4 * scale


def _line(img: np.ndarray, x0: float, y0: float, x1: float, y1: float,
          color: tuple[int, int, int], width: int = 1) -> None:
    n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
    for t in np.linspace(0, 1, n + 1):
        x, y = int(round(x0 + (x1 - x0) * t)), int(round(y0 + (y1 - y0) * t))
        img[max(0, y - width // 2): y + width // 2 + 1, max(0, x - width // 2): x + width // 2 + 1] = color


def write_png(img: np.ndarray, path: Path) -> None:
    h, w, _ = img.shape
    raw = b"".join(b"\x00" + img[r].astype(np.uint8).tobytes() for r in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
    Path(path).write_bytes(png)


def plot_series(xs: list[float], ys: list[float], path: Path, title: str,
                width: int = 640, height: int = 400) -> None:
    img = np.full((height, width, 3), 255, np.uint8)
    left, right, top, bottom = 60, width - 20, 40, height - 40
    if not ys:
        _text(img, left, height // 2, f"{title}: no data", (0, 0, 0))
        write_png(img, path)
        return
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = min(0.0, min(ys)), max(1.0, max(ys))

    def px(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * (right - left)

    def py(y: float) -> float:
        return bottom - (y - y0) / (y1 - y0) * (bottom - top)

    grey, black = (210, 210, 210), (0, 0, 0)
    for k in range(6):
        yv = y0 + (y1 - y0) * k / 5
        _line(img, left, py(yv), right, py(yv), grey)
        _text(img, 8, int(py(yv)) - 5, f"{yv:.1f}", black)
    for k in range(6):
        xv = x0 + (x1 - x0) * k / 5
        _text(img, int(px(xv)) - 8, bottom + 10, f"{xv:.0f}", black)
    _line(img, left, top, left, bottom, black)
    _line(img, left, bottom, right, bottom, black)
    _text(img, left, 12, title, black, scale=3)
    pts = list(zip(xs, ys))
    for (a, b), (c, d) in zip(pts, pts[1:]):
        _line(img, px(a), py(b), px(c), py(d), (120, 160, 230))
    k = max(1, len(ys) // 10)
    smooth = np.convolve(ys, np.ones(k) / k, mode="valid")
    sx = xs[k - 1:]
    for (a, b), (c, d) in zip(zip(sx, smooth), list(zip(sx, smooth))[1:]):
        _line(img, px(a), py(b), px(c), py(d), (200, 40, 40), width=3)
    write_png(img, path)


def read_metrics(metrics_path: Path) -> list[dict]:
    """The rows of a metrics.jsonl, one per step, in step order. A step trained again (the
    trainer restarted from a checkpoint before that step; the trainer trims the rows past its
    checkpoint when it starts, but a file copied mid-restart or an older run may hold both)
    counts once: its last row, which describes the update the run kept. A torn or non-JSON line
    is skipped."""
    by_step: dict[object, dict] = {}
    unnumbered: list[dict] = []
    for line in Path(metrics_path).read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if not isinstance(row, dict):
            continue
        if isinstance(row.get("step"), int):
            by_step.pop(row["step"], None)  # re-inserted: the dict keeps the newest last
            by_step[row["step"]] = row
        else:
            unnumbered.append(row)
    return [by_step[s] for s in sorted(by_step)] + unnumbered  # type: ignore[type-var]


def plot_metric(metrics_path: Path, key: str, out: Path) -> None:
    rows = [r for r in read_metrics(metrics_path) if isinstance(r.get(key), (int, float))]
    plot_series([float(r.get("step", i)) for i, r in enumerate(rows)],
                [float(r[key]) for r in rows], out, f"{key} by step")
