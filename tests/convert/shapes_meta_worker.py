"""Worker for test_published_shapes: every published shape, at few layers and its real widths, built
for every rank of every layout on the meta device (megatron_ext/memory/meta_ranks.py), and checked
with the converter's own checks against the shapes transformers gives the same config.

Usage: shapes_meta_worker.py IN.json OUT.json

IN.json: {"layouts": [[tp, pp], ...], "configs": {shape: config.json, a LLaVA's or a Qwen-VL's}}.
OUT.json: {shape: {"tpTppP": {"problems": [...]}}}, the problems the converter would refuse the
layout with (none: it converts), or {"refused": the one-line refusal} for a layout the model cannot take.
"""

import json
import sys
from pathlib import Path

import torch


class HfShapes:
    """The names and shapes of an HF checkpoint of `config`, from transformers' model on meta (what
    the converter reads from safetensors headers)."""

    def __init__(self, config: dict, arch):
        from megatron_ext.convert.hf_checkpoint import hf_model_names, meta_hf_model
        from megatron_ext.convert.mapping import hf_name_of

        normalize = hf_name_of(arch)
        params = {normalize(n): t for n, t in meta_hf_model(config).state_dict().items()}
        self.names = hf_model_names(config)
        self._shapes = {name: params[name].shape for name in self.names}

    def meta(self, name):
        return torch.empty(self._shapes[name], device="meta")


def check_layout(arch, hf: HfShapes, tp: int, pp: int) -> list[str]:
    from megatron_ext.convert import coverage
    from megatron_ext.convert.mapping import hf_only_names, model_mapping
    from megatron_ext.convert.to_megatron import check_model
    from megatron_ext.memory.meta_ranks import rank_models

    reports = [check_model(model, arch, hf) for _, model in rank_models(arch, (tp, pp))]
    return coverage.hf_to_megatron_problems(model_mapping(arch), reports, hf.names, hf_only_names(arch, hf.names))


def main():
    from megatron_ext.errors import UserError
    from megatron_ext.families import complete_config, read_model

    request = json.loads(Path(sys.argv[1]).read_text())
    results = {}
    for name, config in request["configs"].items():
        # Completed as the converter completes a download's config (a Qwen2.5-VL's is flat on the Hub).
        config = complete_config(config)
        arch = read_model(config)
        hf = HfShapes(config, arch)
        results[name] = {}
        for tp, pp in request["layouts"]:
            try:
                arch.check_parallel(tp, pp)
            except UserError as exc:
                results[name][f"tp{tp}pp{pp}"] = {"refused": str(exc)}
                continue
            results[name][f"tp{tp}pp{pp}"] = {"problems": check_layout(arch, hf, tp, pp)}
    Path(sys.argv[2]).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
