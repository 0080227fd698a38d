"""What cannot work under ZeRO the way a script wrote it (gradients read between backward and step, weights
written outside forward) is said after the traceback, and the ways out the message names do work."""

import sys

import pytest

from conftest import SCENARIOS, clean_env, result, run


def test_gradient_read_after_backward_is_explained(scenario):
    proc = scenario("grad_read_after_backward", "2", check=False)
    assert proc.returncode != 0
    assert "TypeError: 'NoneType' object does not support item assignment" in proc.stderr
    assert (
        "accel_ds_fix: the failing code reads a parameter's .grad, which is None here: under accelerate + "
        "DeepSpeed, accelerator.backward() runs DeepSpeed's backward and its optimizer step at once"
    ) in proc.stderr


def test_gradient_read_into_a_variable_lines_earlier_is_explained(scenario):
    # train_custom_diffusion.py's shape: the .grad read sits 9 lines above the line that fails
    proc = scenario("grad_read_into_variable_earlier", "2", check=False)
    assert proc.returncode != 0
    assert "AttributeError: 'NoneType' object has no attribute 'data'" in proc.stderr
    assert "accel_ds_fix: the failing code reads a parameter's .grad, which is None here" in proc.stderr


@pytest.mark.parametrize("stage", ["2", "3"])
def test_a_parameter_hook_masks_gradients_under_zero(scenario, stage):
    # The way out the message names: only the row the hook lets through trains.
    assert result(scenario("masked_gradient_rows", stage)) == {"rows_changed": [2]}


def test_weight_write_outside_forward_under_zero3_is_explained(scenario):
    proc = scenario("weight_write_outside_forward", check=False)
    assert proc.returncode != 0
    assert "IndexError: index 2 is out of bounds for dimension 0 with size 0" in proc.stderr
    assert "accel_ds_fix: under DeepSpeed ZeRO stage 3 each weight is a shape-[0] shard outside forward" in proc.stderr


@pytest.mark.parametrize("stage", ["2", "3"])
def test_safe_set_full_fp32_param_writes_the_trained_copy(scenario, stage):
    # Textual inversion's "restore every row but the new token's after each step", done the ZeRO way.
    assert result(scenario("restored_weight_rows", stage)) == {"rows_changed": [2]}


def test_textual_inversion_under_zero3_is_refused_in_prepare_and_trains_under_zero2(scenario):
    # The textual inversion scripts write embedding rows after each step: under ZeRO-3, with the embedding
    # partitioned, prepare() stops before anything is allocated and names ZeRO-2, where the same script trains.
    refused = scenario("textual_inversion", "3", check=False)
    assert refused.returncode != 0
    assert "ConfigError: accel_ds_fix: CLIPTextModel trains only its input embedding" in refused.stderr
    assert "configs/accelerate_zero2_offload.yaml" in refused.stderr
    assert "merged 2 models" not in refused.stderr and "IndexError:" not in refused.stderr
    # what the refusal spares: let through, the script trains one step and dies in its row write
    allowed = run([sys.executable, SCENARIOS, "textual_inversion", "3"], check=False, warm=True,
                  env=clean_env(ACCEL_DS_FIX_ZERO3_TEXTUAL_INVERSION="allow"))
    assert allowed.returncode != 0 and "IndexError: The shape of the mask" in allowed.stderr
    assert "each weight is a shape-[0] shard outside forward" in allowed.stderr
    # a misspelt value is said to be not understood and does not pass for allow
    misspelt = run([sys.executable, SCENARIOS, "textual_inversion", "3"], check=False, warm=True,
                   env=clean_env(ACCEL_DS_FIX_ZERO3_TEXTUAL_INVERSION="alow"))
    assert "ACCEL_DS_FIX_ZERO3_TEXTUAL_INVERSION='alow' is not understood" in misspelt.stderr
    assert misspelt.returncode != 0 and "ConfigError: accel_ds_fix: CLIPTextModel trains only" in misspelt.stderr
    losses = result(scenario("textual_inversion", "2"))["losses"]
    assert len(losses) == 4 and losses[-1] != losses[0]
