"""Accelerators the planner knows: memory, peak, and the two link classes collectives run over.

Nominal, public per-device figures (one direction), in one place. A *domain* is the set of devices joined by
the fast links: a TPU slice (ICI), a GPU node (NVLink); between domains collectives take the slow links
(TPU multislice DCN, the GPU cluster network). Latency is per ring hop; the planner's step-time predictions
are as good as these numbers, and the README states them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

GiB = 2**30


@dataclass(frozen=True)
class Accelerator:
    name: str
    hbm_bytes: float
    peak_flops: float  # dense bf16, per device
    fast_bw: float  # bytes/s per device over the fast links (ICI, NVLink), one direction
    slow_bw: float  # bytes/s per device across domains (DCN, InfiniBand/RoCE), one direction
    fast_name: str
    slow_name: str
    domain_max: int | None  # devices one fast domain can hold (None: a whole TPU slice, as deployed)
    fast_latency_s: float = 2e-6
    slow_latency_s: float = 10e-6
    hbm_bw: float = 0.0  # bytes/s of HBM per device: the memory side of a roofline
    # Gradients reduced over this many devices or more, the TPU compiler all-reduces each whole, then slices it
    # (None: it reduce-scatters). Measured with libtpu 0.0.20 (docs/planner.md): v5p and v6e at 64 devices, at
    # Llama-3-8B and -70B widths; at 32 they reduce-scatter, and TPU7x's compiler reduce-scatters at 64.
    whole_reduction_devices: int | None = None

    @property
    def tpu(self) -> bool:
        """A TPU: its fast domain is the slice, and XLA's TPU compiler builds what runs on it."""
        return self.domain_max is None


ACCELERATORS: dict[str, Accelerator] = {
    # Cloud TPU system architecture pages: HBM, bf16 peak, ICI per chip; DCN per chip from the hosts' NICs.
    # HBM bandwidth per chip from the same pages: v4 1,228 GB/s, v5e 819, v5p 2,765, v6e 1,640; TPU7x 7,370.
    "v4": Accelerator("TPU v4", 32 * GiB, 275e12, 300e9, 6.25e9, "ICI", "DCN", None, hbm_bw=1228e9),
    "v5e": Accelerator("TPU v5e", 16 * GiB, 197e12, 200e9, 3.1e9, "ICI", "DCN", None, hbm_bw=819e9),
    "v5p": Accelerator("TPU v5p", 95 * GiB, 459e12, 600e9, 6.25e9, "ICI", "DCN", None, hbm_bw=2765e9,
                       whole_reduction_devices=64),
    "v6e": Accelerator("TPU v6e", 32 * GiB, 918e12, 448e9, 3.1e9, "ICI", "DCN", None, hbm_bw=1640e9,
                       whole_reduction_devices=64),
    # TPU7x (Ironwood), docs.cloud.google.com/tpu/docs/tpu7x (2026): 192 GiB HBM and 2,307 TFLOP/s bf16 per chip
    # (4,614 fp8); ICI 1.2 TB/s per chip both ways, as v5p (Google Cloud's Ironwood announcement, April 2025).
    # Its DCN per chip is not published there: v5p's is assumed.
    "tpu7x": Accelerator("TPU7x", 192 * GiB, 2307e12, 600e9, 6.25e9, "ICI", "DCN", None, hbm_bw=7370e9),
    # NVIDIA SXM: NVLink 4 at 900 GB/s both ways; one 400 Gb/s NIC per GPU (an 8-GPU node, as A3/DGX).
    "h100": Accelerator("H100 80GB", 80e9, 989e12, 450e9, 50e9, "NVLink", "network", 8),
    "h200": Accelerator("H200 141GB", 141e9, 989e12, 450e9, 50e9, "NVLink", "network", 8),
}


def for_device_kind(kind: str) -> Accelerator | None:
    """The table entry for a backend's device kind ('NVIDIA H100 80GB HBM3', 'tpu v5p-128', 'cpu'), if any."""
    kind = kind.lower()
    for key in ("h100", "h200", "tpu7x"):
        if key in kind:
            return ACCELERATORS[key]
    match = re.search(r"\bv(\d)(p|e|litepod)?\b|\bv(\d)(p|e|litepod)?-", kind) if "tpu" in kind else None
    if match:
        generation, variant = match.group(1) or match.group(3), match.group(2) or match.group(4) or ""
        key = f"v{generation}{'e' if variant == 'litepod' else variant}"
        return ACCELERATORS.get(key)
    return None


def accelerator(name: str) -> Accelerator:
    key = name.lower().removeprefix("tpu").strip(" -_")
    key = "v5e" if key.startswith("v5lite") else "tpu7x" if key in ("7x", "v7x", "ironwood") else key
    if key not in ACCELERATORS:
        raise KeyError(name)
    return ACCELERATORS[key]
