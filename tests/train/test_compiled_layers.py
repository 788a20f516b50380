"""--compile-layers: every transformer layer compiled by torch.compile trains like the eager layers
(fp32, CPU) and compiles whole: the trainer says what torch.compile left uncompiled (a graph broken, a
frame given up after too many recompilations), and here it says nothing. With
--gradient-accumulation-fusion too, and at --tp 2 (`model/compiled_linear.py`: megatron-core's own linear
would break every layer's graph)."""

from __future__ import annotations

import pytest

from tests.support.training import metrics, train, trainer_args

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]


FP8 = {"fp8": True, "fp8_backend": "torchao"}


@pytest.mark.parametrize("tp,pp,compiled_only,both,rel", [
    (1, 1, {}, {}, 1e-5), (1, 2, {}, {}, 1e-5), (2, 1, {}, {}, 1e-5),
    (1, 1, {"gradient_accumulation_fusion": True}, {}, 1e-5), (2, 1, {"gradient_accumulation_fusion": True}, {}, 1e-5),
    (2, 1, {}, {"lora_rank": 4}, 1e-5), (1, 1, {}, FP8, 1e-3)],
    ids=["pp1", "pp2", "tp2", "pp1-wgrad-fusion", "tp2-wgrad-fusion", "tp2-lora", "pp1-fp8-torchao"])
def test_compiled_layers_train_like_eager_ones_and_break_no_graph(tmp_path, megatron_clip, train_data, tp, pp,
                                                                  compiled_only, both, rel):
    """At PP 1 and 2; at TP 2, where the column-parallel linears all-reduce their input gradients
    (`model/compiled_linear.py`: megatron-core's asynchronous all-reduce would break every layer's graph),
    with LoRA's adapters too (their own tensor-parallel regions); the fused weight gradients against the
    eager layers' plain ones; torchao's float8 linears compiled and eager (their scales rounded to float8
    as inductor fuses them: within 1e-3)."""
    if both.get("fp8"):
        pytest.importorskip("torchao", reason="needs torchao (pip install 'megatron-ext[fp8]')")
    runs = {}
    for compiled in (False, True):
        save = tmp_path / f"compiled-{compiled}"
        result = train(tp * pp, *trainer_args(megatron_clip, train_data, save, tp=tp, pp=pp, seq_length=192,
                                              packing_seq_length=192, log_interval=1, compile_layers=compiled, **both,
                                              **(compiled_only if compiled else {})), timeout=800)
        runs[compiled] = metrics(save), result.stdout + result.stderr
    (eager, _), (compiled, output) = runs[False], runs[True]
    assert "--compile-layers: torch.compile left" not in output, output[-3000:]
    assert eager.keys() == compiled.keys() == {1, 2, 3}
    for iteration, expected in eager.items():
        assert compiled[iteration]["loss"] == pytest.approx(expected["loss"], rel=rel)
        assert compiled[iteration]["grad_norm"] == pytest.approx(expected["grad_norm"], rel=rel)


def test_layers_torch_compile_cannot_build_stop_the_run_in_one_line_naming_the_way_out(tmp_path, megatron_clip,
                                                                                        train_data):
    """No working C++ compiler for inductor (on a GPU, a Triton that cannot build its kernels reads the
    same): not torch's traceback from inside the first step, and --debug for it."""
    result = train(1, *trainer_args(megatron_clip, train_data, tmp_path / "save", seq_length=192,
                                    packing_seq_length=192, compile_layers=True),
                   timeout=800, check=False, env={"CXX": "/bin/false", "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"})
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith(
        "error: torch.compile could not compile (InvalidCxxCompiler: No working C++ compiler found"), result.stderr
    assert "train with --no-compile-layers for eager layers, or add --debug for its whole report" in result.stderr
    assert not list((tmp_path / "save").glob("iter_*"))
