"""Edge cases of merging, each in its own process on the real stack."""

import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import SCENARIOS, clean_env, result, run, skip_without_nvme


def refused(scenario, name, *args):
    """Run a scenario that must fail; return what it said on stderr."""
    proc = scenario(name, *args, check=False)
    assert proc.returncode != 0, proc.stdout[-2000:]
    return proc.stderr


@pytest.mark.parametrize("name", ["shared_params", "paramless_model"])
def test_handled_cases_train_like_hand_written_merge(scenario, name):
    fixed, reference = result(scenario(name)), result(scenario(name, "--reference"))
    assert fixed["losses"] == reference["losses"]
    assert fixed["losses"][0] != fixed["losses"][-1]
    if name == "shared_params":
        assert fixed["still_shared"] is True


def test_two_optimizers_sharing_parameters_is_refused_with_reason(scenario):
    stderr = refused(scenario, "two_optimizers")
    assert "MergeError: accel_ds_fix: a parameter of shape (16, 8) is in both optimizer 1 (AdamW, argument 3 of " \
        "prepare()) and optimizer 2 (AdamW, argument 4 of prepare())" in stderr
    assert "a parameter cannot be trained by two engines" in stderr
    assert "parameter groups" in stderr


def test_optimizer_params_outside_models_are_named(scenario):
    stderr = refused(scenario, "stray_params")
    assert (
        "the optimizer holds 2 parameter(s) that belong to none of the 2 models passed to prepare(): tinyunet "
        "(TinyUNet, argument 1 of prepare()), tinytextencoder (TinyTextEncoder, argument 2 of prepare()) "
        "(shapes: (5, 3), (5,))"
    ) in stderr
    assert "KeyError" not in stderr


def test_bitsandbytes_8bit_under_offload_is_refused_and_the_way_out_trains(scenario):
    stderr = refused(scenario, "bnb_8bit_with_offload")
    assert (
        "the optimizer is bitsandbytes.optim.adamw.AdamW8bit, but the DeepSpeed config offloads the optimizer to "
        "cpu: DeepSpeed's optimizer offload steps with its own 32-bit CPU optimizers"
    ) in stderr
    assert '"zero_force_ds_cpu_optimizer": false' in stderr
    # The suggestion works: DeepSpeed steps bitsandbytes' AdamW8bit itself, with 8-bit states, and it trains.
    out = result(scenario("bnb_8bit_with_offload", "--not-forced"))
    assert out["optimizer"] == "AdamW8bit"
    assert "torch.uint8" in out["state_dtypes"]
    assert out["losses"][-1] < out["losses"][0]


def test_optimizer_without_cpu_version_under_offload_is_refused(scenario):
    stderr = refused(scenario, "sgd_with_offload")
    assert (
        "the optimizer is torch.optim.sgd.SGD, but the DeepSpeed config offloads the optimizer to cpu: DeepSpeed "
        "has no CPU version of SGD, and accelerate would silently replace it by DeepSpeedCPUAdam"
    ) in stderr


def test_deepspeed_cpu_adam_under_offload_trains_like_hand_written_merge(scenario):
    fixed, reference = result(scenario("cpu_adam_with_offload")), result(scenario("cpu_adam_with_offload", "--reference"))
    assert fixed["losses"] == reference["losses"]
    assert fixed["losses"][0] != fixed["losses"][-1]


def test_half_precision_weights_are_explained(scenario):
    proc = scenario("half_precision_weights")
    assert result(proc) == {"scaler": "None"}  # what kohya's --full_fp16 patch would dereference
    warnings = [line for line in proc.stderr.splitlines() if "already in half precision" in line]
    assert warnings == [
        "LOG accel_ds_fix WARNING trainable weights of tinyunet (TinyUNet, argument 1 of prepare()) are already in half "
        "precision. DeepSpeed keeps fp32 master weights of them and trains those, so nothing is lost (diffusers' LoRA "
        "scripts leave a LoRA in bf16 under bf16: nothing to do). kohya's --full_fp16 (and --full_bf16) cast the "
        "models and patch accelerator.scaler, which is None under DeepSpeed (AttributeError): drop those flags and "
        "train fp32 weights with mixed_precision fp16/bf16."
    ]


def test_preparing_proxies_again_is_refused(scenario):
    stderr = refused(scenario, "already_prepared")
    assert (
        "tinyunet (TinyUNet, argument 1 of prepare()) and tinytextencoder (TinyTextEncoder, argument 2 of "
        "prepare()) were already prepared by accelerate"
    ) in stderr


def test_model_passed_twice_is_refused(scenario):
    stderr = refused(scenario, "model_passed_twice")
    assert "arguments 1 and 3 of prepare() are the same TinyUNet object (tinyunet)" in stderr
    assert "pass every model exactly once" in stderr


def test_merge_is_said_on_stderr_without_logging(scenario):
    proc = scenario("merge_line_without_logging")
    assert (
        "accel_ds_fix: merged 2 models into one DeepSpeed engine (ZeRO stage 2): tinyunet (TinyUNet, 552 params, "
        "552 trainable), tinytextencoder (TinyTextEncoder, 816 params, 816 trainable)"
    ) in proc.stderr.splitlines()


def test_zero3_models_partitioned_before_prepare_count_full_sizes(scenario):
    proc = scenario("zero3_partitioned_at_load")
    out = result(proc)
    assert out["shard_numel"] == 0  # the text encoder's parameters are ZeRO-3 shards, as HfDeepSpeedConfig makes them
    assert "tinytextencoder (TinyTextEncoder, 816 params, 816 trainable)" in proc.stderr
    assert out["losses"][-1] != out["losses"][0]


def test_zero3_bf16_model_partitioned_at_load_beside_a_plain_one_trains_in_one_precision(scenario):
    # kohya's train_db.py under a ZeRO-3 tier: transformers' text encoder arrives as bf16 ZeRO-3 shards, the UNet
    # in fp32. DeepSpeed alone left the UNet fp32 and stopped (AssertionError in ZeRO-3's defragment).
    proc = scenario("zero3_partitioned_at_load_bf16")
    fixed, reference = result(proc), result(scenario("zero3_partitioned_at_load_bf16", "--reference"))
    assert fixed["dtypes"] == reference["dtypes"] == ["torch.bfloat16"]
    assert "already in half precision" not in proc.stderr  # DeepSpeed's own doing, not kohya's --full_fp16
    assert fixed["losses"] == reference["losses"]
    assert fixed["losses"][-1] != fixed["losses"][0]


def test_zero3_transformers_loads_with_low_cpu_mem_usage_as_diffusers_asks(scenario):
    # transformers >= 4.51 drops the argument itself; tests/test_matrix.py's points with transformers 4.44 run this
    from importlib.metadata import version

    from packaging.version import Version

    if Version(version("transformers")) >= Version("4.51"):
        pytest.skip("transformers >= 4.51 drops low_cpu_mem_usage under ZeRO-3 itself")
    assert "low_cpu_mem_usage" in result(scenario("zero3_low_cpu_mem_usage", "--reference"))["error"]
    fixed = result(scenario("zero3_low_cpu_mem_usage"))
    assert fixed["partitioned"] is True and fixed["equal"] is True and fixed["count"] > 0


@pytest.mark.parametrize("when", ["in the loop", "before prepare"])
def test_zero3_frozen_model_loaded_but_not_prepared_is_used_whole(scenario, when):
    # diffusers' Flux scripts under ZeRO-3: their frozen T5, loaded by transformers as shards and never prepared,
    # stopped at its first use ("'weight' must be 2-D" in the embedding), with or without the fix before.
    args = ["--used-before-prepare"] if when == "before prepare" else []
    proc = scenario("zero3_frozen_unprepared", *args)
    out = result(proc)
    assert out["loaded_partitioned"] is True  # the premise: from_pretrained gave shards
    assert out["whole_after_prepare"] is True
    # the checkpoint's weights, in the dtype the script's .to() asked (the shards are bf16)
    assert out["t5_dtypes"] == (["torch.float32"] if args else ["torch.bfloat16"])
    assert set(out["t5_output_diff"]) == ({"before_prepare", "after_training"} if args else {"after_training"})
    assert all(diff == 0.0 for diff in out["t5_output_diff"].values())
    assert out["clip_changed"] == out["clip_tensors"]  # the prepared, partitioned CLIP still trains
    # loaded again after training (the scripts' final save): whole, in host memory, the checkpoint's values; its
    # save_pretrained wrote shape-[0] tensors before
    assert out["reloaded_after_training_equal"] is True and out["reloaded_devices"] == ["cpu"]
    assert "T5EncoderModel was loaded partitioned" in proc.stderr and "gathered whole" in proc.stderr


def test_zero3_move_to_the_card_before_prepare_is_held_for_prepare_to_partition(scenario):
    # diffusers' LoRA scripts move the frozen base to the card before prepare(): Flux's 24 GB transformer, which
    # ZeRO-3 with offloaded weights keeps in host memory. The meta device stands in for the card.
    proc = scenario("zero3_held_move")
    fixed, reference = result(proc), result(scenario("zero3_held_move", "--reference"))
    assert fixed["held"] == {"trained": ["cpu"], "frozen": ["cpu"]}  # still in host memory, values kept
    assert fixed["held_dtypes"] == ["torch.bfloat16"]  # the dtype of the same .to() is applied at once
    assert fixed["held_reports"] == ["meta", "meta"]  # .device: where the script sent it, for its inputs to follow
    assert fixed["reports_after_prepare"] == "meta"
    assert fixed["used_before_prepare"] == ["meta", ["meta"]]  # moved before its first forward
    assert fixed["frozen_after_prepare"] == ["meta"]  # not prepared: moved where the script asked, at prepare()
    assert fixed["losses"] == reference["losses"]  # partitioned from what was held: the same training
    assert fixed["losses"][-1] != fixed["losses"][0]
    assert fixed["moved_after_prepare"] == ["meta"]  # after prepare() a move is a move
    assert "ZeRO-3: CLIPTextModel.to(meta) before prepare() is held back" in proc.stderr


def test_load_hook_failing_in_its_deepspeed_branch_is_explained_and_can_be_skipped(scenario):
    # diffusers' train_dreambooth_lora_sd3.py --train_text_encoder never resumed under DeepSpeed: its load hook's
    # DeepSpeed branch rebuilds the text encoders without their LoRA adapters ('no attribute peft_config').
    stderr = refused(scenario, "load_hook_with_deepspeed_branch")
    assert "object has no attribute 'peft_config'" in stderr
    assert "accel_ds_fix: this error is in the script's load_state pre-hook load_model_hook" in stderr
    assert "scenarios.py's hook builds models there that have no LoRA adapters ('no attribute peft_config')" in stderr
    assert "train_dreambooth_lora_sd3" not in stderr  # the script that failed is named, not another
    assert "ACCEL_DS_FIX_LOAD_HOOKS=skip" in stderr
    proc = run([sys.executable, SCENARIOS, "load_hook_with_deepspeed_branch"],
               env=clean_env(ACCEL_DS_FIX_LOAD_HOOKS="skip"), warm=True)
    assert result(proc) == {"restored": True}  # DeepSpeed's checkpoint brought every weight back
    assert "1 load hook(s) of the script not run (ACCEL_DS_FIX_LOAD_HOOKS=skip)" in proc.stderr


def test_one_model_meets_accelerates_own_checks_and_errors_first(scenario):
    """accelerate's test_autofill_comm_buffers_dsconfig: with one model, accelerate's ValueError for "auto" bucket
    sizes without a model.config hidden size comes word for word, not DeepSpeed's from the fix's partitioning; with
    a hidden size accelerate fills them and the model is partitioned as before."""
    fixed = result(scenario("one_model_auto_buckets"))
    assert fixed == result(scenario("one_model_auto_buckets", "--reference"))
    assert fixed["no config"].startswith("ValueError: Can't find `model.config` entry")
    assert fixed["config without hidden size"].startswith(
        "ValueError: Can find neither `model.config.hidden_size` nor `model.config.hidden_sizes`")
    assert fixed["config with hidden size"] == {"reduce_bucket_size": 16 * 16, "partitioned": True}  # WIDTH 16


@pytest.mark.quick
def test_a_hook_error_that_names_the_proxys_type_names_the_model_behind_it():
    # diffusers' full Flux fine-tune's save hook raises "Wrong model supplied: type(model)=<class ...ModelProxy>"
    # where plain accelerate names CLIPTextModel (issue 41, item 4)
    import torch
    from accel_ds_fix.merge.proxy import ModelProxy, name_the_models

    proxy = ModelProxy(torch.nn.Linear(2, 2), None, "linear")
    error = ValueError(f"Wrong model supplied: {type(proxy)=}.")
    name_the_models(error, [proxy])
    assert error.__notes__ == [
        "accel_ds_fix: ModelProxy in this error is the fix's stand-in for a merged model; the hook was given Linear "
        "(models.linear). Without DeepSpeed the error would name the model's own class: the script checks "
        "type(model), which is the stand-in's, where isinstance(model, TheClass) holds for it, or "
        "accelerator.unwrap_model(model) gives the model itself."]
    other = ValueError("Wrong model supplied: Linear")
    name_the_models(other, [proxy])
    assert not getattr(other, "__notes__", None)


@pytest.mark.quick
def test_a_load_hook_error_of_another_kind_is_not_put_down_to_the_deepspeed_branch():
    # train_dreambooth_sd3.py's full fine-tune hook fails in model(**config), with or without DeepSpeed
    from accel_ds_fix.checkpoints import load_hooks

    def load_model_hook(models, input_dir):
        pass

    error = TypeError("__init__() got an unexpected keyword argument '_class_name'")
    load_hooks._explain(error, load_model_hook)
    note = error.__notes__[0]
    assert note.startswith("accel_ds_fix: this error is in the script's load_state pre-hook load_model_hook (")
    assert "If the same resume fails without DeepSpeed, the hook itself is at fault." in note
    assert "train_dreambooth_lora_sd3" not in note and "ACCEL_DS_FIX_LOAD_HOOKS=skip" in note


def test_few_cpu_threads_under_offload_are_said(scenario):
    from accel_ds_fix.launch.cpu_threads import cores_per_process

    if cores_per_process() < 2:
        pytest.skip("one core: nothing more to use")
    proc = run([sys.executable, SCENARIOS, "offload_threads"], env=clean_env(OMP_NUM_THREADS="1"))
    assert result(proc) == {"threads": 1}
    said = [line for line in proc.stderr.splitlines() if "CPU optimizer (optimizer offload) will step on" in line]
    assert len(said) == 1
    cores = cores_per_process()
    assert f"will step on 1 CPU thread(s), but this process may use {cores} cores" in said[0]
    assert f"launch with OMP_NUM_THREADS={cores} in the environment" in said[0]


def test_training_too_large_for_the_host_stops_before_allocating(scenario):
    line = next(line for line in refused(scenario, "too_large_for_host").splitlines() if "MemoryPlanError: accel_ds_fix:" in line)
    assert "accel_ds_fix: this training will not fit: host memory: about " in line
    assert "GiB needed at the peak" in line and "GiB available" in line
    assert "3000.1M parameters, 3000.1M trainable" in line
    assert "Nothing was allocated. Set ACCEL_DS_FIX_MEMORY_CHECK=warn to go on anyway." in line


def test_nvme_sub_groups_kept_in_ram_beyond_the_host_are_named_with_what_fits(scenario, request):
    skip_without_nvme()
    from accel_ds_fix.memory import tiers

    # a folder on a disk (the NVMe check refuses a tmpfs /tmp before the memory check is reached)
    tmp_path = Path(tempfile.mkdtemp(dir=Path(tiers.DEFAULT_NVME_PATH).parent))
    request.addfinalizer(lambda: shutil.rmtree(tmp_path, ignore_errors=True))
    line = next(line for line in refused(scenario, "nvme_ram_too_large_for_host", tmp_path).splitlines()
                if "MemoryPlanError: accel_ds_fix:" in line)
    assert "accel_ds_fix: this training will not fit: host memory: about " in line
    kept = re.search(r"; of the host memory, ([0-9.]+) GiB are the optimizer sub groups the config keeps off the "
                     r"disk \(accel_ds_fix.nvme_optimizer_ram_gib: 64\)(: set it to ([0-9.]+) \(slower steps, the "
                     r"same training\)|, and even with none kept the rest needs about [0-9.]+ GiB more)", line)
    assert kept and float(kept.group(1)) == pytest.approx(1800.1e6 * 16 / 2**30, abs=0.1)  # every sub group
    assert kept.group(3) is None or float(kept.group(3)) < float(kept.group(1))
    assert "Nothing was allocated." in line and not list(tmp_path.iterdir())


def test_memory_check_setting_not_understood_is_said_and_the_check_stays_on():
    proc = run([sys.executable, SCENARIOS, "too_large_for_host"], env=clean_env(ACCEL_DS_FIX_MEMORY_CHECK="wran"),
               check=False, warm=True)
    assert proc.returncode != 0
    assert ("ACCEL_DS_FIX_MEMORY_CHECK='wran' is not understood: use error (the default), warn or off; checking as "
            "error.") in proc.stderr
    assert "MemoryPlanError: accel_ds_fix: this training will not fit" in proc.stderr


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
        "tinyunet (TinyUNet, 552 params, 552 trainable), tinytextencoder (TinyTextEncoder, 816 params, 816 trainable)",
        # the scenario's DeepSpeedPlugin leaves gradient_clipping to accelerate
        "LOG accel_ds_fix the DeepSpeed engine clips the gradients' norm to 1 at every step (the DeepSpeed config's "
        'gradient_clipping is "auto", which accelerate fills with 1). Without DeepSpeed a script clips only where it '
        "calls accelerator.clip_grad_norm_(). Set gradient_clipping in the DeepSpeed config to choose (0: no "
        "clipping).",
    ]


def test_offload_check_goes_by_the_optimizer_class_not_its_name():
    # accelerate keeps the algorithm only for torch's own classes: a look-alike named AdamW (as
    # transformers.AdamW was) would run as DeepSpeedCPUAdam in Adam mode, so it is refused.
    import torch

    from accel_ds_fix.errors import MergeError
    from accel_ds_fix.merge.merge_plan import check_offloadable

    params = [torch.nn.Parameter(torch.zeros(2))]

    class AdamW(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})

    for kept in (torch.optim.AdamW(params), torch.optim.Adam(params), torch.optim.Adagrad(params)):
        check_offloadable(kept, "cpu")
    with pytest.raises(MergeError, match=r"the optimizer is test_merge_cases.AdamW, but the DeepSpeed config offloads"):
        check_offloadable(AdamW(params), "cpu")
