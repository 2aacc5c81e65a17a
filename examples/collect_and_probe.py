"""Collect prompt rows of 3,000 statements on two replicas (Ray) into one store, then train a
probe from the store. Runs offline on the bundled tiny model (docs/collect.md).

Rerun it with the same working directory (``python examples/collect_and_probe.py DIR``) and
the collection skips every statement already stored.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from probehook.logs import quiet_vllm

ENGINE = dict(max_model_len=64, enforce_eager=True, **quiet_vllm())


def main() -> None:
    from probehook import ActivationStore, LinearProbe, tiny_model_path
    from probehook.collect import collect
    from probehook.tasks.arithmetic import all_pairs, probe_statements

    args = [a for a in sys.argv[1:] if a != "-v"]
    work = Path(args[0]) if args else Path(tempfile.mkdtemp(prefix="probehook-collect-"))
    texts, labels = probe_statements(all_pairs()[:1500], seed=0)  # true and false statements
    ids = [f"statement-{k}" for k in range(len(texts))]
    result = collect(
        tiny_model_path(),
        texts,
        ids=ids,
        store=work / "store",
        layers=[3],  # the last of 4: the truth signal forms there (docs/tiny-model.md)
        replicas=2,
        batch_size=128,
        **ENGINE,
    )
    print(
        f"{result.captured} statements captured ({result.skipped} already stored), "
        f"{result.tokens:,} tokens in {result.seconds:.1f} s on {result.replicas} replicas: "
        f"{result.tokens_per_second:,.0f} tokens/s"
    )
    for lane, counts in sorted(result.per_replica.items()):
        print(f"  {lane}: {counts['items']} statements")

    store = ActivationStore.open(work / "store")
    truth = dict(zip(ids, labels, strict=True))
    labels_by_record = {r.store_id: truth[r.item_id] for r in store.requests}
    probe = LinearProbe.fit(store, layer=3, labels=labels_by_record, phase="prefill", token="last")
    print(f"store: {len(store)} statements, lanes {store.lanes[1:]}")
    print(f"probe on layer 3, held-out accuracy {probe.metrics['accuracy']:.3f}")


if __name__ == "__main__":
    main()
