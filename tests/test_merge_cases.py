"""Edge cases of merging, each in its own process on the real stack."""

import json

import pytest


def result(proc):
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", ["shared_params", "paramless_model"])
def test_handled_cases_train_like_hand_written_merge(scenario, name):
    fixed, reference = result(scenario(name)), result(scenario(name, "--reference"))
    assert fixed["losses"] == reference["losses"]
    assert fixed["losses"][0] != fixed["losses"][-1]
    if name == "shared_params":
        assert fixed["still_shared"] is True


def test_two_optimizers_is_refused_with_reason(scenario):
    proc = scenario("two_optimizers", check=False)
    assert proc.returncode != 0
    assert "MergeError: accel_ds_fix: this prepare() call holds 2 optimizers" in proc.stderr
    assert "one engine with exactly one optimizer" in proc.stderr
    assert "parameter groups" in proc.stderr


def test_optimizer_params_outside_models_are_named(scenario):
    proc = scenario("stray_params", check=False)
    assert proc.returncode != 0
    assert "the optimizer holds 2 parameter(s) that belong to none of the 2 models" in proc.stderr
    assert "shapes: (5, 3), (5,)" in proc.stderr
    assert "KeyError" not in proc.stderr


def test_optimizer_without_cpu_version_under_offload_is_refused(scenario):
    proc = scenario("sgd_with_offload", check=False)
    assert proc.returncode != 0
    assert (
        "the optimizer is torch.optim.sgd.SGD, but the DeepSpeed config offloads the optimizer to cpu: DeepSpeed "
        "has no CPU version of SGD, and accelerate would silently replace it by DeepSpeedCPUAdam"
    ) in proc.stderr


def test_half_precision_weights_are_explained(scenario):
    proc = scenario("half_precision_weights")
    assert result(proc) == {"scaler": "None"}  # what kohya's --full_fp16 patch would dereference
    warnings = [line for line in proc.stderr.splitlines() if "already in half precision" in line]
    assert warnings == [
        "LOG accel_ds_fix WARNING trainable weights of tinyunet are already in half precision. Under DeepSpeed, "
        "train fp32 weights with mixed_precision fp16/bf16: DeepSpeed keeps fp32 master weights itself. kohya's "
        "--full_fp16 (and --full_bf16) cast the models and patch accelerator.scaler, which is None under "
        "DeepSpeed (AttributeError): drop those flags."
    ]


def test_preparing_proxies_again_is_refused(scenario):
    proc = scenario("already_prepared", check=False)
    assert proc.returncode != 0
    assert "TinyUNet, TinyTextEncoder was already prepared by accelerate" in proc.stderr


def test_one_model_is_left_to_accelerate(scenario):
    assert result(scenario("one_model")) == {"type": "DeepSpeedEngine", "patched": True}


def test_without_deepspeed_nothing_is_merged(scenario):
    out = result(scenario("not_deepspeed"))
    assert out["types"] == ["TinyUNet", "TinyTextEncoder"]
    assert out["same"] == [True, True]
    assert out["losses"][0] != out["losses"][-1]


def test_auto_bucket_sizes_use_merged_hidden_size(scenario):
    out = result(scenario("auto_bucket_sizes"))
    assert out["reduce_bucket_size"] == 16 * 16  # widest model layer of the tiny models
    assert len(out["losses"]) == 4


def test_proxy_behaves_like_the_model(scenario):
    proc = scenario("proxy_behaviour")
    out = result(proc)
    assert out == {
        "isinstance": [True, True, True],
        "attribute_is_original": True,
        "setattr_reaches_model": True,
        "eval_returns_proxy": True,
        "training": [True, False],
        "unwrap": True,
        "param_count": True,
        "output_shape": [2, 8],
    }
    log_lines = [line for line in proc.stderr.splitlines() if line.startswith("LOG accel_ds_fix")]
    assert log_lines == [
        "LOG accel_ds_fix merged 2 models into one DeepSpeed engine (ZeRO stage 2): "
        "tinyunet (TinyUNet, 552 params, 552 trainable), tinytextencoder (TinyTextEncoder, 816 params, 816 trainable)"
    ]


def test_offload_check_goes_by_the_optimizer_class_not_its_name():
    # accelerate keeps the algorithm only for torch's own classes: a look-alike named AdamW (as
    # transformers.AdamW was) would run as DeepSpeedCPUAdam in Adam mode, so it is refused.
    import torch

    from accel_ds_fix.errors import MergeError
    from accel_ds_fix.plan import _check_offloadable

    params = [torch.nn.Parameter(torch.zeros(2))]

    class AdamW(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})

    for kept in (torch.optim.AdamW(params), torch.optim.Adam(params), torch.optim.Adagrad(params)):
        _check_offloadable(kept, "cpu")
    with pytest.raises(MergeError, match=r"the optimizer is test_merge_cases.AdamW, but the DeepSpeed config offloads"):
        _check_offloadable(AdamW(params), "cpu")
