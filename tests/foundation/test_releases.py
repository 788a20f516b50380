"""One code base for the megatron-core releases we support (compat/releases.py): the pin, and what
differs between 0.16 and 0.19, each checked on the release installed here (CI runs both)."""

from __future__ import annotations

import sys
import tomllib
from importlib.metadata import version

import pytest

from tests.support.helpers import REPO_ROOT, child_env, run


def test_the_pin_pyproject_installs_is_the_one_our_refusals_name_and_the_installed_release_is_within_it():
    from packaging.requirements import Requirement

    from megatron_ext.compat import releases

    dependencies = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert releases.SUPPORTED in dependencies
    assert Requirement(releases.SUPPORTED).specifier.contains(version("megatron-core"))


def test_a_layers_mlp_spec_is_built_and_read_in_the_installed_releases_form():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules

    from megatron_ext.compat.releases import mlp_spec, mlp_submodules

    ours = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    assert mlp_submodules(mlp_spec(ours)) is ours
    theirs = get_gpt_layer_local_spec().submodules.mlp
    assert type(mlp_spec(ours)) is type(theirs)
    assert mlp_submodules(theirs).linear_fc2 is RowParallelLinear


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_importing_megatron_core_after_us_calls_no_git_and_prints_nothing():
    """0.19 appends `git rev-parse`'s commit to its version (here the checkout's, the venv being inside
    it), and its import of torch.utils.cpp_extension logs that a CUDA torch finds no CUDA runtime."""
    env = {k: v for k, v in child_env().items() if k != "NO_VCS_VERSION"}
    probe = "import megatron_ext, megatron.core, torch.utils.cpp_extension; print(megatron.core.__version__)"
    result = run([sys.executable, "-c", probe], env=env, timeout=100, fresh=True)
    assert result.stdout.strip() == version("megatron-core")
    assert result.stderr == ""
