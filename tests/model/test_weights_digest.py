"""weights_digest: every byte of every weight file the loader reads, cached per file in the user's
cache folder (``KVTIER_CACHE_DIR``) and re-hashed when a file changes."""

from __future__ import annotations

import builtins
import json
import os
import shutil
import stat

import pytest

from kvtier.model import weights_digest
from kvtier.model.digest_cache import CACHE_DIR_ENV, FILE_NAME


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    path = tmp_path / "user-cache" / "kvtier"
    monkeypatch.setenv(CACHE_DIR_ENV, str(path))
    return path


@pytest.fixture
def llama(checkpoint, tmp_path):
    """A private copy of the tiny llama checkpoint (the tests change its bytes)."""
    return shutil.copytree(checkpoint("llama-tiny"), tmp_path / "llama")


def flip_byte(file, offset: int) -> None:
    with open(file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def count_weight_opens(monkeypatch) -> list[str]:
    """Paths of weight files opened from now on (every byte read goes through one)."""
    opened: list[str] = []
    real_open = builtins.open

    def spy(file, *args, **kwargs):
        if str(file).endswith(".safetensors"):
            opened.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", spy)
    return opened


def test_one_byte_changed_in_the_middle_of_a_shard_changes_the_digest(llama, tmp_path):
    shard = llama / "model.safetensors"
    other = shutil.copytree(llama, tmp_path / "finetune")
    size = shard.stat().st_size
    data_start = 8 + int.from_bytes(shard.read_bytes()[:8], "little")
    offset = data_start + (size - data_start) // 4
    # not in the windows the sampled digest read (start, middle and end, 64 KiB each)
    windows = [data_start, data_start + (size - data_start) // 2, size - (64 << 10)]
    assert all(not w <= offset < w + (64 << 10) for w in windows)

    flip_byte(other / "model.safetensors", offset)

    assert weights_digest(other) != weights_digest(llama)


def test_same_bytes_in_another_directory_give_the_same_digest(llama, tmp_path):
    assert weights_digest(shutil.copytree(llama, tmp_path / "copy")) == weights_digest(llama)


def test_a_shard_in_a_sub_folder_named_by_the_index_is_hashed(llama):
    (llama / "sub").mkdir()
    (llama / "model.safetensors").rename(llama / "sub" / "model-00001-of-00001.safetensors")
    index = json.dumps({"weight_map": {"lm_head.weight": "sub/model-00001-of-00001.safetensors"}})
    (llama / "model.safetensors.index.json").write_text(index)
    before = weights_digest(llama)

    flip_byte(llama / "sub" / "model-00001-of-00001.safetensors", 1000)

    assert weights_digest(llama) != before


def test_an_index_naming_a_file_outside_the_checkpoint_is_refused(llama):
    (llama / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../x.safetensors"}}))
    with pytest.raises(ValueError, match=r"\.\./x\.safetensors"):
        weights_digest(llama)


def test_second_digest_reads_no_weight_bytes(llama, monkeypatch):
    first = weights_digest(llama)
    opened = count_weight_opens(monkeypatch)

    assert weights_digest(llama) == first
    assert opened == []


def test_a_changed_file_is_hashed_again(llama, monkeypatch):
    shard = llama / "model.safetensors"
    first = weights_digest(llama)
    flip_byte(shard, 1000)  # same size: mtime/ctime tell
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    opened = count_weight_opens(monkeypatch)

    assert weights_digest(llama) != first
    assert opened == [str(shard)]


def test_a_file_of_another_size_is_hashed_again(llama, monkeypatch):
    shard = llama / "model.safetensors"
    weights_digest(llama)
    st = shard.stat()
    with open(shard, "ab") as f:
        f.write(b"\0")
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))  # even with the old mtime
    opened = count_weight_opens(monkeypatch)

    weights_digest(llama)

    assert opened == [str(shard)]


def test_cache_folder_and_file_are_private(llama, cache_dir):
    weights_digest(llama)
    assert stat.S_IMODE(cache_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((cache_dir / FILE_NAME).stat().st_mode) == 0o600
    assert [p.name for p in cache_dir.iterdir()] == [FILE_NAME]  # no temp file left behind


@pytest.mark.parametrize(
    "content", [b"not json{", b'{"version": 1, "files": []}', b'{"version": 1, "files": {"x": 3}}', b"\xff\xfe"]
)
def test_a_corrupt_cache_is_ignored_and_rewritten(llama, cache_dir, monkeypatch, content):
    expected = weights_digest(llama)
    (cache_dir / FILE_NAME).write_bytes(content)
    opened = count_weight_opens(monkeypatch)

    assert weights_digest(llama) == expected
    assert len(opened) == 1
    assert json.loads((cache_dir / FILE_NAME).read_text())["version"] == 1


def test_a_cache_file_others_may_write_is_not_trusted(llama, cache_dir, monkeypatch):
    weights_digest(llama)
    os.chmod(cache_dir / FILE_NAME, 0o666)
    opened = count_weight_opens(monkeypatch)

    weights_digest(llama)

    assert len(opened) == 1


def test_dummy_weights_are_named_by_their_config_and_device_type_not_their_files(llama, tmp_path):
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(llama / "config.json", copy / "config.json")  # config alone: no weight files
    assert weights_digest(copy, load_format="dummy") == weights_digest(llama, load_format="dummy")
    config = json.loads((copy / "config.json").read_text())
    config["rms_norm_eps"] = config["rms_norm_eps"] * 10  # other weights: other KV
    (copy / "config.json").write_text(json.dumps(config))
    assert weights_digest(copy, load_format="dummy") != weights_digest(llama, load_format="dummy")
    # CPU and CUDA generators draw different numbers from one seed
    assert weights_digest(llama, "dummy", "cpu") != weights_digest(llama, "dummy", "cuda")
    assert weights_digest(llama, "dummy", "cuda:1") == weights_digest(llama, "dummy", "cuda")
