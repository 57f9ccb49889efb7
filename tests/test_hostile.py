"""Issue #53's acceptance, short: one `kvrelay serve` on a tiny model, and each hostile or
careless client of tests/hostile.py in turn beside four streams, every stream ending
`stop` or `length`; then no worker declared dead, nothing leaked, a fresh request served.
`make hostile` runs the long version."""
from __future__ import annotations

from hostile import ATTACKS, run_attacks
from kvrelay.engine.models.testing import make_tiny_model_dir
from serving_helpers import running_server


def test_every_hostile_client_leaves_four_streams_whole(tmp_path):
    model = make_tiny_model_dir(tmp_path / "tiny", arch="llama", seed=0, max_position_embeddings=8192)
    with running_server("--model", f"random:{model}", "--dtype", "float32") as url:
        outcomes = run_attacks(url, list(ATTACKS), short=True)
    assert [o.attack for o in outcomes] == [*ATTACKS, "afterwards"]
    failed = {o.attack: o.problems for o in outcomes if o.problems}
    assert not failed, failed
