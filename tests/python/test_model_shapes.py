"""The model shapes live once as data (bench/models/models.json); kt_bench's
compiled-in table (bench/model_shapes.h) must hold the same models and values."""
import json
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIELDS = ("hidden", "moe_intermediate", "experts", "top_k", "moe_layers")


def test_kt_bench_table_matches_models_json():
    with open(os.path.join(ROOT, "bench", "models", "models.json")) as f:
        models = {name: shape for name, shape in json.load(f).items() if not name.startswith("_")}
    with open(os.path.join(ROOT, "bench", "model_shapes.h")) as f:
        rows = re.findall(r'\{"([^"]+)",\s*(\d+),\s*(\d+),\s*(\d+),\s*(\d+),\s*(\d+)\}', f.read())
    table = {name: dict(zip(FIELDS, map(int, values))) for name, *values in rows}
    assert table == {name: {k: shape[k] for k in FIELDS} for name, shape in models.items()}
