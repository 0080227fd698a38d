"""`plan --model` on Flux, SD3/SD3.5 and SDXL pipeline folders: what the scripts prepare, train and keep on the card,
counted from the safetensors headers (written here with made-up shapes in the real tensors' names, no data)."""

import dataclasses
import json
import struct
import sys

import pytest

from accel_ds_fix.memory import advice, model as memory_model, pipelines, tiers
from accel_ds_fix.memory.model_files import numel as size
from conftest import run

pytestmark = pytest.mark.quick  # no DeepSpeed engine: the quick loop runs it (scripts/test.sh --quick)

GIB = memory_model.GIB
CLIP = {"text_model.embeddings.token_embedding.weight": (1000, 32),
        "text_model.encoder.layers.0.self_attn.q_proj.weight": (32, 32),
        "text_model.encoder.layers.0.self_attn.k_proj.weight": (32, 32),
        "text_model.encoder.layers.0.self_attn.v_proj.weight": (32, 32),
        "text_model.encoder.layers.0.self_attn.out_proj.weight": (32, 32),
        "text_model.encoder.layers.0.mlp.fc1.weight": (64, 32)}
T5 = {"shared.weight": (500, 48), "encoder.block.0.layer.0.SelfAttention.q.weight": (48, 48)}
VAE = {"encoder.conv_in.weight": (8, 3, 3, 3)}
FLUX = {"x_embedder.weight": (96, 16),
        "transformer_blocks.0.attn.to_q.weight": (96, 96), "transformer_blocks.0.attn.add_k_proj.weight": (96, 96),
        "transformer_blocks.0.ff.net.0.proj.weight": (384, 96), "transformer_blocks.0.ff.net.2.weight": (96, 384),
        "transformer_blocks.0.norm1.linear.weight": (576, 96),
        "single_transformer_blocks.0.attn.to_k.weight": (96, 96),
        "single_transformer_blocks.0.proj_mlp.weight": (384, 96)}
SD3 = {"pos_embed.pos_embed": (1, 4096, 64), "pos_embed.proj.weight": (64, 16, 2, 2),
       "transformer_blocks.0.attn.to_q.weight": (64, 64), "transformer_blocks.0.attn.to_add_out.weight": (64, 64),
       "transformer_blocks.0.ff.net.0.proj.weight": (256, 64)}
SDXL = {"down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.weight": (64, 64),
        "down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k.weight": (64, 128),
        "conv_in.weight": (32, 4, 3, 3)}


def numel(shapes):
    return sum(size(s) for s in shapes.values())


def write_pipeline(folder, class_name, components):
    """A pipeline folder whose safetensors files hold headers only (what `plan` reads)."""
    folder.mkdir()
    (folder / "model_index.json").write_text(json.dumps({"_class_name": class_name}))
    for name, shapes in components.items():
        (folder / name).mkdir()
        header, offset = {}, 0
        for key, shape in shapes.items():
            nbytes = 2 * size(shape)
            header[key] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header).encode()
        (folder / name / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    return folder


@pytest.fixture
def flux(tmp_path):
    return write_pipeline(tmp_path / "flux", "FluxPipeline",
                          {"transformer": FLUX, "text_encoder": CLIP, "text_encoder_2": T5, "vae": VAE})


def lora(r, *shapes):
    return sum(r * (i + o) for o, i in shapes)


def test_flux_lora_with_its_text_encoder_counts_what_the_script_trains_and_keeps_on_the_card(flux):
    c = pipelines.count(str(flux), pipelines.family_of(str(flux)), train_text_encoder=True, lora_rank=4)
    assert c.family.name == "Flux.1" and c.prepared == ("transformer", "text_encoder")
    # the script's targets: attention (to_q, add_k_proj, to_k of the single block) and both feed-forwards; not
    # the norms' linear, not proj_mlp; on CLIP the four attention projections
    transformer_lora = lora(4, (96, 96), (96, 96), (384, 96), (96, 384), (96, 96))
    clip_lora = lora(4, (32, 32), (32, 32), (32, 32), (32, 32))
    assert c.trainable == transformer_lora + clip_lora
    assert c.trained_tensors == 2 * (5 + 4)  # A and B of each wrapped weight: what ZeRO-2 handles one by one
    assert c.params == numel(FLUX) + numel(CLIP) + c.trainable
    # T5 encodes each step's prompts, so it stays on the card in bf16 beside the VAE; the frozen base is moved
    # there by the script before prepare()
    assert dict(c.frozen_what) == {"vae": 2 * numel(VAE), "text_encoder_2": 2 * numel(T5)}
    assert c.moved_before_prepare == 2 * (numel(FLUX) + numel(CLIP))
    assert c.weight_bytes == 2 and c.largest_weight == 576 * 96  # the norm's linear, the largest
    # loaded before the script casts: diffusers' transformer and VAE in fp32, the text encoders as stored (bf16)
    assert c.loaded_bytes == 4 * (numel(FLUX) + numel(VAE)) + 2 * (numel(CLIP) + numel(T5))


def test_flux_full_fine_tune_without_text_encoder_prepares_the_transformer_alone(flux):
    c = pipelines.count(str(flux), pipelines.family_of(str(flux)), train_text_encoder=False)
    assert c.prepared == ("transformer",) and c.trainable == c.params == numel(FLUX)
    assert c.trained_tensors == len(FLUX)
    assert dict(c.frozen_what) == {"vae": 2 * numel(VAE)} and c.moved_before_prepare == 0 and c.weight_bytes == 4


def test_sd3_full_trains_all_three_text_encoders_lora_two_and_its_positional_buffer_is_no_parameter(tmp_path):
    folder = write_pipeline(tmp_path / "sd3", "StableDiffusion3Pipeline",
                            {"transformer": SD3, "text_encoder": CLIP, "text_encoder_2": CLIP, "text_encoder_3": T5,
                             "vae": VAE})
    family = pipelines.family_of(str(folder))
    buffer = 4096 * 64
    full = pipelines.count(str(folder), family, train_text_encoder=True)
    assert full.prepared == ("transformer", "text_encoder", "text_encoder_2", "text_encoder_3")
    assert full.trainable == numel(SD3) - buffer + 2 * numel(CLIP) + numel(T5)
    assert dict(full.frozen_what) == {"transformer buffers": 2 * buffer, "vae": 4 * numel(VAE)}
    lora_run = pipelines.count(str(folder), family, train_text_encoder=True, lora_rank=8)
    assert lora_run.prepared == ("transformer", "text_encoder", "text_encoder_2")
    assert lora_run.trainable == lora(8, (64, 64), (64, 64)) + 2 * lora(8, *[(32, 32)] * 4)
    assert dict(lora_run.frozen_what)["text_encoder_3"] == 2 * numel(T5)


def test_sdxl_lora_targets_the_unets_attention_and_both_clips(tmp_path):
    folder = write_pipeline(tmp_path / "sdxl", "StableDiffusionXLPipeline",
                            {"unet": SDXL, "text_encoder": CLIP, "text_encoder_2": CLIP, "vae": VAE})
    c = pipelines.count(str(folder), pipelines.family_of(str(folder)), train_text_encoder=True, lora_rank=2)
    assert c.prepared == ("unet", "text_encoder", "text_encoder_2")
    assert c.trainable == lora(2, (64, 64), (64, 128)) + 2 * lora(2, *[(32, 32)] * 4)


def test_plan_grid_recommends_per_card_and_ram_and_says_what_no_tier_can_fix(flux):
    out = json.loads(run([sys.executable, "-m", "accel_ds_fix", "plan", "--model", flux, "--lora-rank", "4",
                          "--mixed-precision", "bf16", "--grid", "--json"]).stdout)
    assert [(c["card_gb"], c["ram_gb"]) for c in out["cells"]] == [(g, r) for g in advice.GRID_CARDS_GB
                                                                   for r in advice.GRID_HOSTS_GB]
    assert all(c["tier"] == "zero2-offload" for c in out["cells"])  # a tiny model fits everywhere, fastest first
    assert out["frozen_on_gpu_gib"] == round(2 * (numel(VAE) + numel(T5)) / GIB, 2)
    text = run([sys.executable, "-m", "accel_ds_fix", "plan", "--model", flux, "--grid"]).stdout
    assert "Flux.1 pipeline: transformer" in text and "full fine-tune, with its text encoder(s)" in text


def test_the_base_a_lora_script_moves_to_the_card_before_prepare_bounds_zero2_not_zero3():
    # Flux.1-dev's 11.9B transformer + CLIP-L as diffusers' LoRA script holds them: 22.4 GiB on the card before
    # prepare() under ZeRO-2 (and T5's 8.9 GiB beside them); under ZeRO-3 the fix holds that move back and
    # partitions from host memory one weight at a time (zero3/held_moves.py)
    moved, t5 = int(12.02e9) * 2, int(4.76e9) * 2
    work = memory_model.Workload(params=int(12.07e9), trainable=int(46e6), largest_trainable=3072 * 16,
                                 largest_weight=3072 * 12288, weight_bytes=2, frozen_on_gpu=t5,
                                 moved_before_prepare=moved, activations=int(1.5 * GIB))

    def gpu(tier):
        settings = memory_model.Settings.from_config(tiers.BY_NAME[tier].deepspeed_config(), "bf16")
        return memory_model.predict(work, settings, "cuda").gpu_allocated

    assert gpu("zero2-offload") >= moved + t5
    assert t5 < gpu("zero3-offload") < t5 + 3 * GIB  # T5, the working set and the activations
    assert gpu("zero3-offload") == memory_model.predict(dataclasses.replace(work, moved_before_prepare=0),
                                                        memory_model.Settings.from_config(
                                                            tiers.BY_NAME["zero3-offload"].deepspeed_config(), "bf16"),
                                                        "cuda").gpu_allocated
    # the host's peak is the script's load: the transformer in fp32 beside T5, before anything is cast
    loaded = int(11.9e9) * 4 + t5
    settings = memory_model.Settings.from_config(tiers.BY_NAME["zero3-offload"].deepspeed_config(), "bf16")
    with_load = memory_model.predict(dataclasses.replace(work, loaded_bytes=loaded), settings, "cuda")
    assert with_load.host - memory_model.predict(work, settings, "cuda").host > 20 * GIB
    assert with_load.host >= loaded


def test_lora_rank_needs_a_pipeline_folder(tmp_path):
    proc = run([sys.executable, "-m", "accel_ds_fix", "plan", "--params", "983M", "--lora-rank", "8",
                "--gpu-memory", "8GiB", "--host-memory", "16GiB"], check=False)
    assert proc.returncode == 2 and "--lora-rank, --no-text-encoder and --resolution need --model" in proc.stderr


def test_a_lora_on_a_base_bigger_than_the_card_streams_and_the_plan_says_how_much(tmp_path):
    # Flux.1-dev's LoRA r16 with CLIP-L as diffusers' script runs it (the real pipeline's counts, plan --model on
    # its headers): the base and T5 do not fit a 16 GiB card beside the training, so the fastest tier that fits
    # keeps what the card holds (T5 first, then the transformer's first blocks) and streams the rest. docs/gpu.md
    # run 17 measured 13.45 - 14.82 GiB reserved (with the transformer kept before T5)
    t5 = int(4.762e9) * 2
    work = memory_model.Workload(params=int(12.0705e9), trainable=46006272, largest_trainable=3072 * 16,
                                 largest_weight=3072 * 12288, weight_bytes=2, frozen_on_gpu=t5 + int(83.8e6) * 2,
                                 moved_before_prepare=int(12.02e9) * 2, activations=int(1.5 * GIB),
                                 largest_block=339738624 * 2, loaded_bytes=int(11.9e9) * 4 + t5, trained_tensors=780)
    rows, recommended = advice.plan(work, advice.Machine.given(16 * GIB, 64 * GIB), "bf16", here=False, h2d_gbps=55.4,
                                    compute_seconds=1.12)
    row = {r["tier"]: r for r in rows}["zero2-stream"]
    assert recommended == "zero2-stream" and not {r["tier"]: r for r in rows}["zero2-offload"]["fits_gpu"]
    # the card less 4 GiB for activations and the allocator's 8 % (run 19: 15.46 GiB reserved with 3 GiB kept free)
    assert 8 <= row["frozen_on_card_gib"] <= 10 and row["gpu_reserved_gib"] <= 15.5
    # T5 (8.9 GiB) kept nearly whole: the transformer streams, twice a step
    assert 2 * row["streamed_gib"] - 1 <= row["streamed_per_step_gib"] <= 2 * row["streamed_gib"]
    assert 40 <= row["streamed_per_step_gib"] <= 46 and 0.75 <= row["copy_seconds_per_step"] <= 0.9
    # the step: the computation, and the copies it does not hide (the forward's share of them)
    assert 1.12 < row["stream_step_seconds"] < 1.12 + row["copy_seconds_per_step"] / 2
    # where the host bounds the step, ZeRO-2's own work for each of the 780 trained tensors comes on top (runs 19 -
    # 20: 0.33 - 0.53 ms a tensor), and the plan says so
    assert 0.3 < row["stream_step_host_bound_seconds"] - row["stream_step_seconds"] < 0.4
    assert "up to %.2f s where the host" % row["stream_step_host_bound_seconds"] in " ".join(row["notes"])
    # the pinned host copies are the host's part, beside the optimizer's; the load's peak is the larger
    assert row["host_gib"] >= row["streamed_gib"]
    # a card that holds everything streams nothing: then the tier is zero2-offload with a switch
    rows, recommended = advice.plan(work, advice.Machine.given(80 * GIB, 64 * GIB), "bf16", here=False)
    assert recommended == "zero2-offload" and {r["tier"]: r for r in rows}["zero2-stream"]["streamed_gib"] == 0


def test_plan_writes_the_streaming_split_it_predicts(tmp_path):
    proc = run([sys.executable, "-m", "accel_ds_fix", "plan", "--params", "12070M", "--trainable", "46M",
                "--mixed-precision", "bf16", "--gpu-memory", "16GiB", "--host-memory", "64GiB", "--write", tmp_path,
                "--json"])
    out = json.loads(proc.stdout)
    assert out["recommended"] == "zero2-stream"
    row = next(r for r in out["tiers"] if r["tier"] == "zero2-stream")
    written = json.loads((tmp_path / "ds_zero2_stream.json").read_text())
    assert written["accel_ds_fix"] == {"stream_frozen_weights": True, "card_reserve_gib": 4,
                                       "frozen_on_card_gib": row["frozen_on_card_gib"]}
    assert row["frozen_on_card_gib"] > 5
