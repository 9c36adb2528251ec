#!/usr/bin/env python3
"""Write legacy (pre-zip) copies of two committed `.pth` fixtures, the format torch.save
wrote before PyTorch 1.6 and writes with `_use_new_zipfile_serialization=False`: ESRGAN's
and RCAN's original releases, and many community models of 2019-2020, are such files.

Run from anywhere:  python tests/golden/make_legacy_pth.py
Needs: torch. Nothing is downloaded.

Each copy holds the same state dict as its source, as torch.load reads it back (checked
here): the Rust tests load both and must find the same tensors, bit for bit, and the
source's float64 reference output.
"""

from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
PAIRS = [
    # ESRGAN's old-arch keys in a plain state dict, as RRDB_ESRGAN_x4.pth (2018).
    ("esrgan/esrgan_x4_old.pth", "esrgan/esrgan_x4_old_legacy.pth"),
    # RCAN's keys with its mean shift in a plain state dict, as RCAN_BIX4.pt (2018).
    ("rcan/rcan_x4_shift.pth", "rcan/rcan_x4_shift_legacy.pth"),
]


def main():
    for src, dst in PAIRS:
        sd = torch.load(HERE / src, map_location="cpu", weights_only=True)
        torch.save(sd, HERE / dst, _use_new_zipfile_serialization=False)
        back = torch.load(HERE / dst, map_location="cpu", weights_only=True)
        assert back.keys() == sd.keys()
        assert all(torch.equal(back[k], sd[k]) for k in sd), dst
        with open(HERE / dst, "rb") as f:
            assert not f.read(4).startswith(b"PK"), f"{dst} is a zip archive"
        print(f"{dst}: {len(sd)} tensors, {(HERE / dst).stat().st_size} bytes")


if __name__ == "__main__":
    main()
