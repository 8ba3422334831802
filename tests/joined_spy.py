"""A spy on gdn.ops.joined's split: which blocks' gradients reach its backward already in place."""
from __future__ import annotations


def record_placed(monkeypatch) -> list:
    """Patch the split's backward to append, per call, one bool per block: its gradient arrived as
    its place in the joined buffer (written there by the consumer's kernel). Returns that list."""
    from gdn.ops import joined as joined_mod

    real_bwd = joined_mod._SplitColumns.backward
    placed: list = []

    def spy(ctx, *grads):
        regions = ctx.sink.regions  # (empty where no consumer asked for its place)
        placed.append([g is not None and i < len(regions) and g.data_ptr() == regions[i].data_ptr()
                       for i, g in enumerate(grads)])
        return real_bwd(ctx, *grads)

    monkeypatch.setattr(joined_mod._SplitColumns, "backward", staticmethod(spy))
    return placed
