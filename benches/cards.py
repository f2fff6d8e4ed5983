"""The cards mk is measured on, each known by a word of its device name, with its datasheet HBM
bandwidth: the speed-of-light denominator of every mk benchmark and the columns of the results of
record. Free of torch, so that the scripts that record results run on a machine without a GPU."""

from __future__ import annotations

# Datasheet HBM bandwidth (bytes/s) of each card, by a word of its device name (H100 SXM: HBM3; H200: HBM3e).
HBM_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12}


def card_of(device_name: str | None) -> str | None:
    """The key of HBM_BYTES_PER_S that a device name contains (`NVIDIA H200` gives `H200`), else None."""
    return next((card for card in HBM_BYTES_PER_S if card in (device_name or "")), None)
