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
class WholeReductions:
    """From how many devices the TPU compiler all-reduces a gradient whole (then slices each device's shard)
    where the cost model would reduce-scatter it; None: never, as far as measured. Measured with libtpu 0.0.20
    on the programs it compiles (docs/planner.md: Llama-shaped at widths 1024-8192, Qwen3-MoE-shaped):
    `every`: each gradient, on v5p and v6e at 64 devices (at 32, at 8B and 70B widths, they reduce-scatter).
    The gradients XLA's partitioner sums with an all-reduce and a slice (not a matmul's, which it
    reduce-scatters in a windowed loop), and that the compiler turns into a reduce-scatter only on few devices:
    `experts`, grouped-matmul MoE experts' (`xla_shard.experts`: a partial sum per device leaves its manual
    region), whole from 8 devices of a v5p (reduce-scattered on 4) and on 16 and 64 of a v6e; `embedding`, the
    input embedding's (a lookup's scatter-add, in fp32) where it is split along its rows, whole from 8
    devices of a v5p (reduce-scattered on 4; on a v6e at 32 it reduce-scatters). TPU7x's compiler (libtpu
    0.0.42) goes by the dimension a weight is split along: `experts_last_dim`, grouped experts' split along
    their last (`gate_up_proj`, [experts, 2 x intermediate, width]), whole on 8 and 64 devices where those
    split along another are reduce-scattered; `narrow_last_dim`, a matmul weight split along its last dimension
    to fewer than 128 columns (a TPU tile's lanes) per device: whole on 64 devices (Llama-3-8B's k and v
    projections, Qwen3-30B-A3B's attention output) while the residual stream was fp32 and the embedding split by
    its rows; with bf16 activations and the embedding split by its width the same program reduce-scatters them
    (Llama-3-8B on a tpu7x-64, Nov 28), so no chip sets it now."""

    every: int | None = None
    experts: int | None = None
    embedding: int | None = None
    experts_last_dim: int | None = None
    narrow_last_dim: int | None = None

    @staticmethod
    def reaches(threshold: int | None, devices: int) -> bool:
        return threshold is not None and devices >= threshold


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
    # How the TPU compiler reduces gradients on this chip, where measured (None: it reduce-scatters them all).
    reductions: WholeReductions | None = None

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
                       reductions=WholeReductions(every=64, experts=8, embedding=8)),
    "v6e": Accelerator("TPU v6e", 32 * GiB, 918e12, 448e9, 3.1e9, "ICI", "DCN", None, hbm_bw=1640e9,
                       reductions=WholeReductions(every=64, experts=8)),
    # TPU7x (Ironwood), docs.cloud.google.com/tpu/docs/tpu7x (2026): 192 GiB HBM and 2,307 TFLOP/s bf16 per chip
    # (4,614 fp8); ICI 1.2 TB/s per chip both ways, as v5p (Google Cloud's Ironwood announcement, April 2025).
    # Its DCN per chip is not published there: v5p's is assumed.
    "tpu7x": Accelerator("TPU7x", 192 * GiB, 2307e12, 600e9, 6.25e9, "ICI", "DCN", None, hbm_bw=7370e9,
                         reductions=WholeReductions(experts_last_dim=8)),
    # NVIDIA SXM: NVLink 4 at 900 GB/s both ways; one 400 Gb/s NIC per GPU (an 8-GPU node, as A3/DGX).
    "h100": Accelerator("H100 80GB", 80e9, 989e12, 450e9, 50e9, "NVLink", "network", 8),
    "h200": Accelerator("H200 141GB", 141e9, 989e12, 450e9, 50e9, "NVLink", "network", 8),
    # NVLink 3 at 600 GB/s both ways; one 200 Gb/s NIC per GPU (DGX A100). Both HBM sizes carry the name.
    "a100": Accelerator("A100 80GB", 80e9, 312e12, 300e9, 25e9, "NVLink", "network", 8),
    "a100-40gb": Accelerator("A100 40GB", 40e9, 312e12, 300e9, 25e9, "NVLink", "network", 8),
}


def for_device_kind(kind: str) -> Accelerator | None:
    """The table entry for a backend's device kind ('NVIDIA H100 80GB HBM3', 'tpu v5p-128', 'cpu'), if any."""
    kind = kind.lower()
    for key in ("h100", "h200", "tpu7x"):
        if key in kind:
            return ACCELERATORS[key]
    if "a100" in kind:
        return ACCELERATORS["a100-40gb" if "40gb" in kind else "a100"]
    match = re.search(r"\bv(\d)(p|e|litepod)?\b|\bv(\d)(p|e|litepod)?-", kind) if "tpu" in kind else None
    if match:
        generation, variant = match.group(1) or match.group(3), match.group(2) or match.group(4) or ""
        key = f"v{generation}{'e' if variant == 'litepod' else variant}"
        return ACCELERATORS.get(key)
    return None


def accelerator(name: str) -> Accelerator:
    key = name.lower().removeprefix("tpu").strip(" -_")
    # (v5litepod and v5lite name the generation; v5litepod-16 is a slice, which this does not take)
    key = "v5e" if key in ("v5lite", "v5litepod") else "tpu7x" if key in ("7x", "v7x", "ironwood") else key
    if key not in ACCELERATORS:
        raise KeyError(name)
    return ACCELERATORS[key]
