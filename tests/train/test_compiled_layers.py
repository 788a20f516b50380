"""--compile-layers: every transformer layer compiled by torch.compile trains like the eager layers
(fp32, CPU) and compiles whole: the trainer says what torch.compile left uncompiled (a graph broken, a
frame given up after too many recompilations), and here it says nothing. With
--gradient-accumulation-fusion too (`model/compiled_linear.py`: megatron-core's own linear would break
every layer's graph)."""

from __future__ import annotations

import pytest

from tests.support.training import metrics, train, trainer_args

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]


@pytest.mark.parametrize("pp,fused", [(1, False), (2, False), (1, True)], ids=["pp1", "pp2", "pp1-wgrad-fusion"])
def test_compiled_layers_train_like_eager_ones_and_break_no_graph(tmp_path, megatron_clip, train_data, pp, fused):
    """At PP 1 and 2 (--tp > 1 is refused: tensor-parallel layers all-reduce asynchronously in backward);
    the fused weight gradients against the eager layers' plain ones."""
    runs = {}
    for compiled in (False, True):
        save = tmp_path / f"compiled-{compiled}"
        result = train(pp, *trainer_args(megatron_clip, train_data, save, pp=pp, seq_length=192, packing_seq_length=192,
                                         log_interval=1, compile_layers=compiled,
                                         gradient_accumulation_fusion=fused and compiled), timeout=800)
        runs[compiled] = metrics(save), result.stdout + result.stderr
    (eager, _), (compiled, output) = runs[False], runs[True]
    assert "--compile-layers: torch.compile left" not in output, output[-3000:]
    assert eager.keys() == compiled.keys() == {1, 2, 3}
    for iteration, expected in eager.items():
        assert compiled[iteration]["loss"] == pytest.approx(expected["loss"], rel=1e-5)
        assert compiled[iteration]["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
