"""build_sources: local and remote MDS folders (remote end to end through a file:// downloader
registered with mosaicml-streaming for the test), eval split detection, the path errors."""
import os
import shutil
import urllib.parse

import pytest
import torch

from megatron_taper.config import DataConfig
from megatron_taper.data import STATS_FILE
from megatron_taper.data.sources import build_sources
from megatron_taper.data.streaming import cache_folder
from megatron_taper.data.torchvision_compat import import_streaming
from tests.helpers.datahelpers import corpus, dataset, tokenizer_model  # noqa: F401

SEQ, MB = 32, 2


def _sources(path, cache_dir="", dp_rank=0, dp_size=1):
    return build_sources(DataConfig(path=path, cache_dir=cache_dir), seq_len=SEQ, micro_batch=MB, seed=3,
                         vocab_size=512, dp_rank=dp_rank, dp_size=dp_size)


def _batches(source, n):
    return [source.next_batch() for _ in range(n)]


@pytest.fixture
def file_urls(monkeypatch):
    """mosaicml-streaming has no file:// downloader; register one that copies local files, so the
    remote code path (URL, cache, index and shard downloads) runs for real."""
    import_streaming()
    from streaming.base.storage import download

    class FileUrlDownloader(download.LocalDownloader):
        @staticmethod
        def _client_identifier() -> str:
            return "file"

        def _download_file_impl(self, remote: str, local: str, timeout: float) -> None:
            super()._download_file_impl(urllib.parse.urlparse(remote).path, local, timeout)

    monkeypatch.setitem(download.DOWNLOADER_MAPPINGS, "file", FileUrlDownloader)
    return lambda path: "file://" + os.path.abspath(path)


def test_remote_path_reads_through_the_cache_like_local(dataset, tmp_path, file_urls):
    url, cache = file_urls(dataset), str(tmp_path / "cache")
    train, (held_out,) = _sources(url, cache, 1, 2)  # stats.json lists val
    local_train, (local_held_out,) = _sources(dataset, "", 1, 2)
    assert all(torch.equal(a, b) for a, b in zip(_batches(train, 8), _batches(local_train, 8)))
    assert all(torch.equal(a, b) for a, b in zip(_batches(held_out.make(), 3), _batches(local_held_out.make(), 3)))
    copied = cache_folder(os.path.join(cache, "streaming"), url)
    assert os.path.isfile(os.path.join(copied, STATS_FILE))
    assert any(f.endswith(".mds") for f in os.listdir(os.path.join(copied, "train")))
    assert any(f.endswith(".mds") for f in os.listdir(os.path.join(copied, "val")))


def test_remote_path_without_cache_dir_uses_the_default_cache(dataset, tmp_path, file_urls, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    train, _ = _sources(file_urls(dataset))
    assert train.next_batch().shape == (MB, SEQ + 1)
    assert os.path.isdir(tmp_path / "home" / ".cache" / "megatron_taper" / "streaming")


def test_remote_path_without_val_has_no_eval(corpus, tokenizer_model, tmp_path, file_urls):
    from megatron_taper.data.corpus import SkipLog, read_documents
    from megatron_taper.data.preprocess import preprocess

    out = tmp_path / "noval"
    preprocess(read_documents([corpus["jsonl"]], SkipLog()), tokenizer_model, str(out), skips=SkipLog(),
               val_fraction=0.0, shard_size="16kb", progress=False)
    assert not (out / "val").exists()
    train, held_out = _sources(file_urls(out), str(tmp_path / "cache"))
    assert held_out == [] and train.next_batch().shape == (MB, SEQ + 1)


def test_remote_path_errors(dataset, tmp_path, file_urls):
    # a folder without stats.json (not a complete preprocess output) is refused, naming data.path
    partial = tmp_path / "partial"
    shutil.copytree(dataset, partial)
    os.remove(partial / STATS_FILE)
    with pytest.raises(ValueError, match=r"data.path=file://.*partial: cannot fetch .*stats.json"):
        _sources(file_urls(partial), str(tmp_path / "cache"))
    # a scheme mosaicml-streaming cannot download from: its error, not the local-folder one
    with pytest.raises(ValueError, match=r"data.path=nosuch://bucket/ds: cannot fetch .*Unsupported remote path"):
        _sources("nosuch://bucket/ds", str(tmp_path / "cache"))


def test_local_path_without_train_is_refused(tmp_path):
    (tmp_path / "val").mkdir()
    with pytest.raises(ValueError, match=r"data.path=.* has no train/ split: not a folder written by "
                                         r"tools/preprocess_data.py \(expected a .npy token file or a folder"):
        _sources(str(tmp_path))
