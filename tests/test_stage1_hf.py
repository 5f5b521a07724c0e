"""Stage-1 on a local Qwen3.5 checkpoint directory: its own tokenizer, image processor and token
ids; one-line errors before the model is built; the transformers export (plain torch and ZeRO-2)
loads with from_pretrained and gives the trainer's logits. The checkpoint dirs are built here
(tests/hf_fixtures.py): no hub is reachable."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

from tests.hf_fixtures import document_logits, make_checkpoint
from tests.stage1_fixtures import make_data, run
from train.common.codebooks import CodebookVocab
from train.common.packing import Document, Packer, collate, model_kwargs
from train.common.shapes import get_shape
from train.stage1.data import DataConfig, PackedBatches, build_batch, load_manifests
from train.stage1.export import export_checkpoint
from train.stage1.model import build_model
from train.stage1.objective import CausalLMObjective, ModelInputError
from train.stage1.tokenizer import ByteTokenizer, TokenizerError, build_tokenizer

TINY = get_shape("tiny")


@pytest.fixture(scope="module")
def text_ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt-text"))


@pytest.fixture(scope="module")
def vision_ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt-vision"), vision=True)


def test_checkpoint_tokenizer_is_extended_at_the_embedding_ids(text_ckpt: Path) -> None:
    tok = build_tokenizer(TINY, text_ckpt, vision=False)
    original = AutoTokenizer.from_pretrained(text_ckpt, local_files_only=True)
    vocab = CodebookVocab(TINY.base_vocab, TINY.codebooks)
    assert len(original) < TINY.base_vocab  # the checkpoint's vocab_size exceeds its tokenizer: a gap
    ids = tok.hf.convert_tokens_to_ids(["<|ss_0|>", "<|shape_255|>", "<|tex_3|>", "<|3d_start|>", "<|task_und|>"])
    assert ids == [vocab.offsets["ss"], vocab.offsets["shape"] + 255, vocab.offsets["tex"] + 3,
                   vocab.special_ids["<|3d_start|>"], vocab.special_ids["<|task_und|>"]]
    assert tok.hf.convert_tokens_to_ids(f"<|reserved_{len(original)}|>") == len(original)  # the gap is filled
    assert len(tok.hf) == vocab.used_vocab
    text = "a huge red cube. <|ss_3|>"  # a special token's name inside text stays text
    assert tok.text(text) == original(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(tok.codes3d([1, 2], [3], [4])) == (
        "<|3d_start|><|ss_start|><|ss_1|><|ss_2|><|ss_end|><|shape_start|><|shape_3|><|shape_end|>"
        "<|tex_start|><|tex_4|><|tex_end|><|3d_end|>")
    assert tok.eos_id == original.eos_token_id and str(text_ckpt) in tok.name


def test_a_packed_batch_decodes_back_to_its_input_text(text_ckpt: Path, tmp_path: Path) -> None:
    data = make_data(tmp_path)
    tok = build_tokenizer(TINY, text_ckpt, vision=False)
    ds = PackedBatches(DataConfig(str(data), row_len=256, batch_rows=2, num_workers=0,
                                  weights={"replay_text": 1, "und": 1}), tok, rank=0)
    batch = build_batch(ds.sampler, tok, ds.cfg, 0)
    texts = {rec["text"] for task in ("replay_text", "und") for _, rec in load_manifests(data).records[task]}
    decoded = [tok.decode(row.tolist()) for row in batch["input_ids"]]
    # eos ends a doc and pads a row; after a row's last eos: padding, or the head of a document
    # the row's end cut (rows fill to the end, the tail is dropped)
    docs = [d for row in decoded for d in row.split("<|endoftext|>")[:-1] if d]
    found = 0
    for doc in docs:
        if doc.startswith("<|task_replay_text|>"):
            assert doc[len("<|task_replay_text|>"):] in texts, doc
            found += 1
        elif doc.startswith("<|task_und|><|3d_start|>"):  # 3D tokens by name, then the caption
            assert "<|ss_" in doc and doc.split("<|3d_end|>")[1] in texts, doc
            found += 1
    assert found >= 2, decoded


def test_vision_ids_come_from_the_checkpoint_config(vision_ckpt: Path, tmp_path: Path) -> None:
    tok = build_tokenizer(TINY, vision_ckpt, vision=True)
    config = json.loads((vision_ckpt / "config.json").read_text())
    assert tok.vision_ids["image_token_id"] == config["image_token_id"] == tok.hf.convert_tokens_to_ids("<|image_pad|>")
    assert tok.vision_ids != ByteTokenizer(CodebookVocab(TINY.base_vocab, TINY.codebooks)).vision_ids
    # the checkpoint's own processor: a smaller max_pixels there gives smaller grids here
    proc = json.loads((vision_ckpt / "preprocessor_config.json").read_text())
    small = tmp_path / "small"
    shutil.copytree(vision_ckpt, small)
    proc["size"] = {"shortest_edge": 16 * 16, "longest_edge": 32 * 32}
    (small / "preprocessor_config.json").write_text(json.dumps(proc))
    image = tmp_path / "x.png"
    Image.new("RGB", (64, 64), (200, 30, 30)).save(image)
    assert tok.encoder(image).n_tokens == 16  # 64x64 in 8-pixel patches, 2x2 merged
    assert build_tokenizer(TINY, small, vision=True).encoder(image).n_tokens == 4  # resized to 32x32


def _broken(src: Path, dst: Path, change) -> Path:
    shutil.copytree(src, dst)
    change(dst)
    return dst


def test_one_line_errors_before_the_model_is_built(text_ckpt: Path, vision_ckpt: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    def no_tokenizer(d: Path) -> None:
        (d / "tokenizer.json").unlink()
        (d / "tokenizer_config.json").unlink()

    def other_vocab(d: Path) -> None:
        cfg = json.loads((d / "config.json").read_text())
        cfg["vocab_size"] = 3000
        (d / "config.json").write_text(json.dumps(cfg))

    def unknown_image_id(d: Path) -> None:
        cfg = json.loads((d / "config.json").read_text())
        cfg["image_token_id"] = 3999  # inside the model's vocab, unknown to its tokenizer
        (d / "config.json").write_text(json.dumps(cfg))

    cases = [
        (_broken(text_ckpt, tmp_path / "a", no_tokenizer), False, "no tokenizer there"),
        (_broken(text_ckpt, tmp_path / "b", other_vocab), False, "vocab_size 3000 matches neither"),
        (_broken(vision_ckpt, tmp_path / "c", unknown_image_id), True, "image_token_id 3999 is unknown to its tok"),
        (text_ckpt, True, "no vision tower"),
        (tmp_path / "nowhere", False, "not a directory"),
    ]
    for path, vision, message in cases:
        with pytest.raises(TokenizerError) as err:
            build_tokenizer(TINY, path, vision=vision)
        assert message in str(err.value) and len(str(err.value).splitlines()) == 1, str(err.value)
        out = tmp_path / f"run-{path.name}"
        rc = run(out, make_data(tmp_path), 1, "--init-from", str(path), "--vision", "on" if vision else "off")
        err_lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("train.stage1: error:")]
        # a directory that is not there, and --vision on with a tower-less checkpoint, are argument
        # errors (exit 2, as `launch submit` checks them); the rest are found when the checkpoint is read (exit 1)
        parse_time = path.name == "nowhere" or message == "no vision tower"
        assert rc == (2 if parse_time else 1) and len(err_lines) == 1 and message in err_lines[0], err_lines
        assert not (out / "model_files").exists()  # refused before the model was built


TEXT_TASKS = ("--weights", '{"gen_txt": 1, "und": 1, "replay_text": 1}')


def _trainer_model(job: Path, step: int, vision: bool, init_from: Path | None) -> torch.nn.Module:
    tok = build_tokenizer(TINY, init_from, vision)
    model, _ = build_model("tiny", init_from=init_from, vision=vision, vision_ids=tok.vision_ids)
    state = torch.load(job / "checkpoints" / f"step_{step:08d}" / "model.pt", weights_only=True)
    model.load_state_dict(state)
    return model.eval()


def test_export_loads_with_from_pretrained_and_gives_the_trainer_logits(text_ckpt: Path, tmp_path: Path) -> None:
    data = make_data(tmp_path)
    job = tmp_path / "job"
    # a text-only checkpoint trains the text tasks only, and must say so (the default mixture is refused)
    assert run(job, data, 2, "--init-from", str(text_ckpt), "--ckpt-every", "2") == 1
    assert "task(s) gen_img, replay_img need images" in json.loads((job / "outcome.json").read_text())["error"]
    shutil.rmtree(job)
    assert run(job, data, 2, "--init-from", str(text_ckpt), "--ckpt-every", "2", *TEXT_TASKS) == 0
    summary = json.loads((job / "summary.json").read_text())
    export = Path(summary["export"])
    assert export == (job / "export" / "step_00000002").resolve()
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= {p.name for p in export.iterdir()}
    assert "weights: the module's weights of a plain-torch checkpoint" in (export / "README.md").read_text()

    loaded = AutoModelForCausalLM.from_pretrained(export, local_files_only=True).eval()
    assert loaded.config.use_cache  # the trainer ran without a cache; generation from the export wants one
    trainer = _trainer_model(job, 2, vision=False, init_from=text_ckpt)
    tok = build_tokenizer(TINY, text_ckpt, vision=False)
    diff = max((document_logits(loaded, tok, data, t, 0) - document_logits(trainer, tok, data, t, 0)).abs().max().item()
               for t in ("gen_txt", "und", "replay_text"))
    print(f"export vs trainer: max abs logit diff {diff:.3g}")
    assert diff <= 1e-5

    exported_tok = AutoTokenizer.from_pretrained(export, local_files_only=True)  # round-trips the 3D tokens
    ids = tok.codes3d([0, 255], [7], [9])
    assert exported_tok.convert_tokens_to_ids(exported_tok.convert_ids_to_tokens(ids)) == ids
    assert exported_tok.decode(ids).startswith("<|3d_start|><|ss_start|><|ss_0|><|ss_255|>")

    # --init-from the export continues training with the extended vocab as is
    again = tmp_path / "again"
    assert run(again, data, 1, "--init-from", str(export), "--ckpt-every", "0", *TEXT_TASKS) == 0
    header = json.loads((again / "metrics.jsonl").read_text().splitlines()[0])
    assert header["vocab"] == loaded.config.vocab_size and str(export) in header["tokenizer"]


def test_a_vlm_checkpoint_with_the_default_mixture_trains_all_five_tasks(vision_ckpt: Path, tmp_path: Path,
                                                                          capsys) -> None:
    """--init-from a checkpoint with a vision tower: vision on by default, the image tasks stay in
    the mixture (through the tower), and the step lines carry every task's loss."""
    from train.stage1.train import check_tasks, parse_args

    check_tasks(parse_args(["--init-from", str(vision_ckpt)]), 1)
    job = tmp_path / "job"
    assert run(job, make_data(tmp_path), 4, "--init-from", str(vision_ckpt), "--batch-rows", "2", "--row-len", "256",
               "--ckpt-every", "0") == 0
    out = capsys.readouterr().out
    assert ("# mixture: gen_img 0.218 (images: tower), gen_txt 0.217, und 0.217, replay_img 0.237 (images: tower), "
            "replay_text 0.111") in out
    steps = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()][1:]
    assert set().union(*(r["task_loss"] for r in steps)) == {"gen_img", "gen_txt", "und", "replay_img", "replay_text"}
    assert sum(r["images"] for r in steps) >= 4 and all(r["vision_flops"] > 0 for r in steps if r["images"])
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    for label, task in (("gi", "gen_img"), ("gt", "gen_txt"), ("un", "und"), ("ri", "replay_img"), ("rt", "replay_text")):
        assert any(f"{label} {r['task_loss'][task]:.2f}" in line for r, line in zip(steps, lines, strict=True)
                   if task in r["task_loss"]), label


@pytest.mark.slow
def test_export_of_a_deepspeed_zero2_checkpoint(vision_ckpt: Path, tmp_path: Path) -> None:
    """ZeRO-2 (one gloo rank on CPU): the fp32 masters gathered by DeepSpeed, the `model.` prefix
    of the loss wrapper stripped; equal to the module weights DeepSpeed saved (fp32 on CPU)."""
    data = make_data(tmp_path)
    job = tmp_path / "job"
    assert run(job, data, 1, "--init-from", str(vision_ckpt), "--deepspeed", "on", "--ckpt-every", "1",
               "--export", "off") == 0
    export = export_checkpoint(job, None, tmp_path / "exported")
    assert "fp32 master weights of a DeepSpeed ZeRO-2 checkpoint" in (export / "README.md").read_text()
    assert (export / "preprocessor_config.json").is_file()
    loaded = AutoModelForImageTextToText.from_pretrained(export, local_files_only=True).eval()
    states = next((job / "checkpoints" / "step_00000001" / "deepspeed").glob("mp_rank_00_model_states.pt"))
    module = torch.load(states, weights_only=False, map_location="cpu")["module"]
    tok = build_tokenizer(TINY, vision_ckpt, vision=True)
    trainer, _ = build_model("tiny", init_from=vision_ckpt, vision=True)
    trainer.load_state_dict({k.removeprefix("model."): v for k, v in module.items()})
    trainer.eval()
    diff = max((document_logits(loaded, tok, data, t, 0) - document_logits(trainer, tok, data, t, 0)).abs().max().item()
               for t in ("gen_img", "replay_img", "und"))
    print(f"ZeRO-2 export vs trainer: max abs logit diff {diff:.3g}")
    assert diff <= 1e-5


def test_a_value_error_inside_transformers_is_a_one_line_error(tmp_path: Path) -> None:
    """Placeholders that do not match the image features: transformers' ValueError becomes one line."""
    tok = build_tokenizer(TINY, None, vision=True)
    model, _ = build_model("tiny", vision=True, vision_ids=tok.vision_ids)
    image = tmp_path / "x.png"  # a real image, then one placeholder too few
    Image.new("RGB", (32, 32), (10, 200, 10)).save(image)
    inp = tok.encoder(image)
    ids = tok.vision_ids
    tokens = [1, ids["vision_start_token_id"], *[ids["image_token_id"]] * (inp.n_tokens - 1),
              ids["vision_end_token_id"], 20, 21]
    doc = Document(tokens, 0, [])
    batch = collate(list(Packer(row_len=16).pack([doc])))
    batch.update(pixel_values=inp.pixel_values, image_grid_thw=torch.tensor([inp.grid_thw]))
    kwargs = model_kwargs(batch)
    with pytest.raises(ModelInputError) as err:
        CausalLMObjective(model, "logits")(**kwargs)
    assert len(str(err.value).splitlines()) == 1 and "refused a batch" in str(err.value)
    assert "do not match" in str(err.value), err.value


def test_plain_torch_bf16_export_takes_the_fp32_masters(tmp_path: Path) -> None:
    """A bf16 model trained with MasterWeightAdamW (a GPU run without DeepSpeed): the export takes
    the fp32 masters from optim.pt, not the rounded bf16 weights."""
    from train.common.master_weights import MasterWeightAdamW
    from train.stage1.export import load_weights

    model, _ = build_model("tiny")
    model = model.to(torch.bfloat16)
    opt = MasterWeightAdamW(model.parameters(), lr=1e-3)
    with torch.no_grad():
        for m in opt.masters:
            m.add_(1e-4)  # below bf16's resolution near 1: visible only in the masters
    ckpt = tmp_path / "step_00000001"
    ckpt.mkdir()
    torch.save(model.state_dict(), ckpt / "model.pt")
    torch.save({"optimizer": opt.state_dict()}, ckpt / "optim.pt")
    fresh, _ = build_model("tiny")
    what = load_weights(ckpt, fresh)
    assert what.startswith("fp32 master weights of a plain-torch checkpoint")
    name, master = next((n, m) for (n, p), m in zip(model.named_parameters(), opt.masters, strict=True)
                        if p.dim() == 2)
    assert torch.equal(dict(fresh.named_parameters())[name].detach(), master.detach())
    assert not torch.equal(dict(fresh.named_parameters())[name].detach(), master.detach().bfloat16().float())
