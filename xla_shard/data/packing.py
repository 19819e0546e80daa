"""Examples of any length packed into rows of exactly `seq_len` tokens, each example kept apart.

Best-fit decreasing, as TRL's `pack_dataset(strategy="bfd")` packs (the default of its `SFTTrainer`): within each
batch of 1,000 examples (the `datasets` map batch TRL's packing runs in), the longest example first, each into
the open row whose free space fits it most tightly, else a new row. The same lengths give TRL's rows, example
for example (`tests/test_sft.py` holds it to `trl.pack_dataset`). Where TRL leaves a row shorter and its
collator pads the batch, each row here is padded to `seq_len`, so that XLA compiles one step.

Each example's positions start at 0 (attention keeps examples apart by them: a block-diagonal mask, or the flash
kernel's segment ids), and its first token is not a target (it would be predicted from the example before).
The row's filler is an example of its own, unlabelled; `real_tokens` counts what is not filler.
"""

from __future__ import annotations

from collections import defaultdict, deque

IGNORE = -100  # the label transformers' losses skip
BATCH = 1000  # examples per packing pass: TRL's (datasets' default map batch)


class _Spaces:
    """The free spaces of the open rows, from 1 to `capacity`: the smallest one that fits a length, found in
    log time (a max segment tree over the space values, as TRL's)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.size = 1 << (capacity - 1).bit_length()
        self.tree = [0] * (2 * self.size)

    def _set(self, space: int, value: int) -> None:
        i = self.size + space - 1
        self.tree[i] = value
        while i > 1:
            i >>= 1
            left, right = self.tree[2 * i], self.tree[2 * i + 1]
            self.tree[i] = left if left >= right else right

    def add(self, space: int) -> None:
        self._set(space, space)

    def remove(self, space: int) -> None:
        self._set(space, 0)

    def fitting(self, length: int) -> int:
        """The smallest free space >= `length` (capacity, a new row, where none is smaller)."""
        i = 1
        while i < self.size:
            i = 2 * i if self.tree[2 * i] >= length else 2 * i + 1
        return self.tree[i]


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Rows of example indices: each example (longest first; equal lengths in their order) into the row whose free
    space fits it most tightly, else a new row. Every length is at most `capacity`."""
    spaces = _Spaces(capacity)
    spaces.add(capacity)  # a new row is always there to take
    rows: list[list[int]] = []
    by_space: dict[int, deque[list[int]]] = defaultdict(deque)
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        length = lengths[index]
        if length == 0:
            continue
        space = spaces.fitting(length)
        if space < capacity:
            row = by_space[space].popleft()
            if not by_space[space]:
                spaces.remove(space)
        else:
            row = []
            rows.append(row)
        row.append(index)
        space -= length
        by_space[space].append(row)
        if space > 0:
            spaces.add(space)
    return rows


def split_long(ids: list[list[int]], labels: list[list[int]], seq_len: int):
    """Examples longer than `seq_len` cut into pieces of `seq_len` (the last shorter), as TRL's `bfd_split`."""
    out_ids, out_labels = [], []
    for example_ids, example_labels in zip(ids, labels):
        for start in range(0, max(len(example_ids), 1), seq_len):
            out_ids.append(example_ids[start:start + seq_len])
            out_labels.append(example_labels[start:start + seq_len])
    return out_ids, out_labels


def pack(rows, seq_len: int, pad_id: int, num_proc: int | None, split: bool = False):
    """`rows` (input_ids and labels, one example each, at most `seq_len` long unless `split`) packed best-fit
    decreasing into rows of `seq_len` tokens: input_ids, labels, position_ids, real_tokens."""
    def pack_batch(batch):
        ids, labels = batch["input_ids"], batch["labels"]
        if split:
            ids, labels = split_long(ids, labels, seq_len)
        else:
            ids, labels = [x[:seq_len] for x in ids], [x[:seq_len] for x in labels]
        out = {"input_ids": [], "labels": [], "position_ids": [], "real_tokens": []}
        for members in best_fit_decreasing([len(x) for x in ids], seq_len):
            row_ids = [t for i in members for t in ids[i]]
            row_labels = [t for i in members for t in [IGNORE] + list(labels[i][1:])]
            positions = [p for i in members for p in range(len(ids[i]))]
            fill = seq_len - len(row_ids)
            out["input_ids"].append(row_ids + [pad_id] * fill)
            out["labels"].append(row_labels + [IGNORE] * fill)
            out["position_ids"].append(positions + list(range(fill)))
            out["real_tokens"].append(len(row_ids))
        return out

    return rows.map(pack_batch, batched=True, batch_size=BATCH, remove_columns=rows.column_names, num_proc=num_proc)


def fill_rate(rows, seq_len: int) -> float:
    """Real (not filler) tokens over the tokens the packed rows hold."""
    return sum(rows["real_tokens"]) / (len(rows) * seq_len) if len(rows) else 0.0


def real_fraction(rows, seq_len: int) -> float | None:
    """The share of the rows' tokens that are not filler or padding (None: every token is real)."""
    if "real_tokens" in rows.column_names:
        return fill_rate(rows, seq_len)
    if "attention_mask" in rows.column_names:
        import numpy as np

        mask = np.asarray(rows.with_format("numpy")["attention_mask"])
        return float(mask.mean()) if mask.size else None
    return None
