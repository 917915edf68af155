"""`ember fetch-model` against a local hub that speaks the Hugging Face hub's file API (tests/hub_server.py,
checked first against huggingface_hub's own client) and a real S3-compatible server (SeaweedFS,
tests/s3_server.py): fetched files equal the source's, digests are checked, transfers resume, the token
stays on the hub's origin, and failures end in one fatal line that says why."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hub_server import Hub, serving
from s3_server import S3Server

EMBER = str(Path(sys.executable).parent / "ember")
REPO_ID = "ember-test/tiny"


def fetch(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [EMBER, "fetch-model", *args, "--progress-interval", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def tree(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in root.rglob("*")
        if p.is_file() and not p.name.startswith(".ember-fetch")
    }


@pytest.fixture
def checkpoint(tiny_model: Path, tmp_path: Path) -> Path:
    """The tiny test checkpoint as a hub repository holds one: plus a README, a subfolder, and a
    pytorch_model.bin that the engine does not load."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for f in tiny_model.iterdir():
        if f.is_file():
            (repo / f.name).write_bytes(f.read_bytes())
    (repo / "README.md").write_text("# tiny\n")
    (repo / "extra").mkdir()
    (repo / "extra" / "notes.txt").write_text("a file in a folder\n")
    (repo / "pytorch_model.bin").write_bytes(os.urandom(4096))
    return repo


@pytest.fixture
def hub(checkpoint: Path) -> Iterator[Hub]:
    with serving(REPO_ID, checkpoint) as hub:
        yield hub


def expected_files(checkpoint: Path) -> dict[str, bytes]:
    return {k: v for k, v in tree(checkpoint).items() if not k.endswith(".bin")}


def test_the_local_hub_serves_huggingface_hubs_own_client(hub: Hub, checkpoint: Path, tmp_path: Path) -> None:
    """The oracle for the test server: the official client downloads the repository from it."""
    from huggingface_hub import snapshot_download

    out = snapshot_download(
        REPO_ID,
        revision="main",
        endpoint=hub.hub_url,
        token=hub.token,
        local_dir=tmp_path / "hf",
        cache_dir=tmp_path / "cache",
    )
    got = {k: v for k, v in tree(Path(out)).items() if not k.startswith(".cache/")}
    assert got == tree(checkpoint)


def test_fetch_from_the_hub_pins_the_commit_checks_digests_and_keeps_the_token_on_the_hub(
    hub: Hub, checkpoint: Path, tmp_path: Path
) -> None:
    dest = tmp_path / "cache" / "tiny"
    done = fetch(f"hf://{REPO_ID}@main", str(dest), "--endpoint", hub.hub_url, env={"HF_TOKEN": hub.token})
    assert done.returncode == 0, done.stdout + done.stderr
    assert tree(dest) == expected_files(checkpoint)  # byte for byte; the .bin skipped
    commit = hub.repos[REPO_ID].commit
    assert f"revision {commit}" in done.stdout
    # The LFS weights by their sha256, every other file by its git blob id.
    assert f"digests checked: {len(expected_files(checkpoint)) - 1} git-sha1, 1 sha256" in done.stdout
    assert "% " in done.stdout or "%)" in done.stdout  # progress lines
    hub_requests = [(path, h) for origin, path, h in hub.requests if origin == "hub"]
    storage_requests = [(path, h) for origin, path, h in hub.requests if origin == "storage"]
    # Every file is read at the commit the branch pointed to, with the token; the storage never sees it.
    resolves = [path for path, _ in hub_requests if "/resolve/" in path]
    assert resolves and all(f"/resolve/{commit}/" in path for path in resolves)
    assert all(h.get("Authorization") == f"Bearer {hub.token}" for _, h in hub_requests)
    assert storage_requests and not any("Authorization" in h for _, h in storage_requests)
    # The tree came in pages.
    assert sum("cursor=" in path for path, _ in hub_requests) >= 2
    ledger = json.loads((dest / ".ember-fetch.json").read_text())
    assert ledger["complete"] is True and ledger["revision"] == commit

    # Again: nothing is downloaded a second time.
    before = len(hub.requests)
    again = fetch(f"hf://{REPO_ID}", str(dest), "--endpoint", hub.hub_url, env={"HF_TOKEN": hub.token})
    assert again.returncode == 0, again.stderr
    assert not any("/resolve/" in path or origin == "storage" for origin, path, _ in hub.requests[before:])
    assert f"0 fetched (0 resumed), {len(expected_files(checkpoint))} already there" in again.stdout


def test_a_cut_transfer_resumes_where_it_stopped(hub: Hub, checkpoint: Path, tmp_path: Path) -> None:
    weights = (checkpoint / "model.safetensors").read_bytes()
    sha = hashlib.sha256(weights).hexdigest()
    hub.cut_once.add(sha)
    dest = tmp_path / "out"
    done = fetch(f"hf://{REPO_ID}", str(dest), "--endpoint", hub.hub_url, env={"HF_TOKEN": hub.token})
    assert done.returncode == 0, done.stdout + done.stderr
    assert (dest / "model.safetensors").read_bytes() == weights
    ranges = [h.get("Range") for origin, path, h in hub.requests if origin == "storage" and sha in path]
    # The second request asks for the rest of what the first delivered (whole chunks of it were written).
    assert len(ranges) == 2 and ranges[0] is None and ranges[1] is not None, ranges
    assert 0 < int(ranges[1].removeprefix("bytes=").rstrip("-")) <= len(weights) // 2, ranges
    assert "resuming at" in done.stdout and "1 resumed" in done.stdout


def test_a_partial_file_from_an_earlier_run_is_resumed(hub: Hub, checkpoint: Path, tmp_path: Path) -> None:
    """What a restarted init container finds in its emptyDir."""
    weights = (checkpoint / "model.safetensors").read_bytes()
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "model.safetensors.incomplete").write_bytes(weights[:1000])
    done = fetch(f"hf://{REPO_ID}", str(dest), "--endpoint", hub.hub_url, env={"HF_TOKEN": hub.token})
    assert done.returncode == 0, done.stdout + done.stderr
    assert (dest / "model.safetensors").read_bytes() == weights
    assert not (dest / "model.safetensors.incomplete").exists()
    ranges = [h.get("Range") for origin, _, h in hub.requests if origin == "storage"]
    assert ranges == ["bytes=1000-"]


def test_content_that_does_not_match_its_sha256_is_refused(
    hub: Hub, checkpoint: Path, tmp_path: Path
) -> None:
    sha = hashlib.sha256((checkpoint / "model.safetensors").read_bytes()).hexdigest()
    hub.corrupt.add(sha)
    dest = tmp_path / "out"
    done = fetch(f"hf://{REPO_ID}", str(dest), "--endpoint", hub.hub_url, env={"HF_TOKEN": hub.token})
    assert done.returncode == 1
    (fatal,) = [line for line in done.stderr.splitlines() if "fatal:" in line]
    assert "model.safetensors: content does not match: sha256" in fatal and sha in fatal
    assert not (dest / "model.safetensors").exists()


@pytest.mark.parametrize(
    ("source", "token", "says"),
    [
        (
            f"hf://{REPO_ID}",
            None,
            f"repository {REPO_ID} not found, or private and not readable without a token",
        ),
        (f"hf://{REPO_ID}", "hf_wrong", "not readable with the given HF_TOKEN"),
        (f"hf://{REPO_ID}@v9", "ok", "revision 'v9' not found"),
        ("hf://ember-test/missing", "ok", "repository ember-test/missing not found"),
    ],
)
def test_hub_errors_say_what_is_wrong(
    hub: Hub, tmp_path: Path, source: str, token: str | None, says: str
) -> None:
    env = {"HF_TOKEN": hub.token if token == "ok" else token} if token else {"HF_TOKEN": ""}
    done = fetch(source, str(tmp_path / "out"), "--endpoint", hub.hub_url, env=env)
    assert done.returncode == 1
    assert says in done.stderr and "ember fetch-model: fatal: the hub answered 40" in done.stderr, done.stderr


def test_a_renamed_repository_is_followed_with_the_token(hub: Hub, checkpoint: Path, tmp_path: Path) -> None:
    hub.renamed["old-org/tiny"] = REPO_ID
    done = fetch(
        "hf://old-org/tiny", str(tmp_path / "out"), "--endpoint", hub.hub_url, env={"HF_TOKEN": hub.token}
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert tree(tmp_path / "out") == expected_files(checkpoint)


def test_a_directory_is_copied_with_sizes_checked(checkpoint: Path, tmp_path: Path) -> None:
    done = fetch(str(checkpoint), str(tmp_path / "out"), "--include", "*.json", "--include", "*.safetensors")
    assert done.returncode == 0, done.stderr
    assert tree(tmp_path / "out") == {
        k: v for k, v in tree(checkpoint).items() if k.endswith((".json", ".safetensors"))
    }
    missing = fetch(str(tmp_path / "nowhere"), str(tmp_path / "out2"))
    assert missing.returncode == 1 and "is not a directory" in missing.stderr


# -- S3 ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = S3Server(tmp_path_factory.mktemp("seaweedfs"))
    try:
        yield server
    finally:
        server.close()


def test_fetch_from_an_s3_compatible_server(s3: S3Server, checkpoint: Path, tmp_path: Path) -> None:
    client = s3.client()
    client.create_bucket(Bucket="models")
    files = tree(checkpoint)
    for key, data in files.items():
        # The weights with a SHA-256 checksum, the rest with their MD5 ETag only.
        extra = {"ChecksumAlgorithm": "SHA256"} if key.endswith(".safetensors") else {}
        client.put_object(Bucket="models", Key=f"llama/tiny/{key}", Body=data, **extra)
    client.put_object(Bucket="models", Key="llama/tiny-other/config.json", Body=b"{}")  # a sibling prefix
    dest = tmp_path / "out"
    done = fetch("s3://models/llama/tiny", str(dest), "--endpoint", s3.endpoint, env=s3.env())
    assert done.returncode == 0, done.stdout + done.stderr
    assert tree(dest) == expected_files(checkpoint)
    assert "1 sha256" in done.stdout and f"{len(expected_files(checkpoint))} md5" in done.stdout

    # A partial file from an interrupted run resumes with a ranged GET.
    weights = files["model.safetensors"]
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    (resumed / "model.safetensors.incomplete").write_bytes(weights[:5000])
    again = fetch("s3://models/llama/tiny", str(resumed), "--endpoint", s3.endpoint, env=s3.env())
    assert again.returncode == 0, again.stderr
    assert (resumed / "model.safetensors").read_bytes() == weights
    assert "model.safetensors: resuming at" in again.stdout

    bad = fetch(
        "s3://models/llama/tiny",
        str(tmp_path / "bad"),
        "--endpoint",
        s3.endpoint,
        env={**s3.env(), "AWS_SECRET_ACCESS_KEY": "wrong"},
    )
    assert bad.returncode == 1 and "fatal:" in bad.stderr and "SignatureDoesNotMatch" in bad.stderr, (
        bad.stderr
    )
    absent = fetch("s3://no-such-bucket/x", str(tmp_path / "absent"), "--endpoint", s3.endpoint, env=s3.env())
    assert absent.returncode == 1 and "NoSuchBucket" in absent.stderr, absent.stderr


def test_fetch_model_imports_no_torch(tmp_path: Path) -> None:
    code = (
        "import sys; from ember_engine.fetch import cli, files, hub, s3, local; print('torch' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, check=True
    )
    assert result.stdout.strip() == "False"


def test_a_whole_partial_file_is_checked_where_it_lies(hub: Hub, checkpoint: Path, tmp_path: Path) -> None:
    """A run killed between the last write and the rename leaves a partial file of the whole size: it asked
    for the bytes past the end (a 416 from real storage, so every rerun failed). Its digest is checked where
    it lies now, nothing fetched; and the progress counts it."""
    weights = (checkpoint / "model.safetensors").read_bytes()
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "model.safetensors.incomplete").write_bytes(weights)
    done = fetch(f"hf://{REPO_ID}", str(dest), "--endpoint", hub.hub_url, env={"HF_TOKEN": hub.token})
    assert done.returncode == 0, done.stdout + done.stderr
    assert (dest / "model.safetensors").read_bytes() == weights
    sha = hashlib.sha256(weights).hexdigest()
    assert [h.get("Range") for origin, path, h in hub.requests if origin == "storage" and sha in path] == []
    last = [line for line in done.stdout.splitlines() if "%)" in line][-1]
    assert "(100%)" in last, last  # it counted only what it fetched: resumed bytes were left out
    # A whole-size partial whose content is not the file's: fetched again from the start.
    again = tmp_path / "again"
    again.mkdir()
    (again / "model.safetensors.incomplete").write_bytes(bytes(len(weights)))
    done = fetch(f"hf://{REPO_ID}", str(again), "--endpoint", hub.hub_url, env={"HF_TOKEN": hub.token})
    assert done.returncode == 0, done.stdout + done.stderr
    assert (again / "model.safetensors").read_bytes() == weights


def _copy_tree(src: Path, dst: Path) -> None:
    for f in src.rglob("*"):
        if f.is_file():
            (dst / f.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
            (dst / f.relative_to(src)).write_bytes(f.read_bytes())


def test_a_directory_that_changed_is_fetched_whole_and_leaves_nothing_of_before(
    checkpoint: Path, tmp_path: Path
) -> None:
    """A directory publishes no digests: a partial file of the earlier revision was resumed into the new one
    (a corrupt file, reported done), and the earlier revision's files stayed beside the new ones (old shards
    and their index, which the engine then loaded)."""
    source, dest = tmp_path / "source", tmp_path / "dest"
    source.mkdir()
    _copy_tree(checkpoint, source)
    weights = (source / "model.safetensors").read_bytes()
    (source / "model.safetensors").unlink()
    half = len(weights) // 2
    (source / "model-00001-of-00002.safetensors").write_bytes(weights[:half])
    (source / "model-00002-of-00002.safetensors").write_bytes(weights[half:])
    (source / "model.safetensors.index.json").write_text("{}")
    assert fetch(str(source), str(dest)).returncode == 0
    # the next revision: one file of weights, the shards gone
    for name in (
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ):
        (source / name).unlink()
    (source / "model.safetensors").write_bytes(weights)
    # an earlier run of it was cut: a partial file whose bytes are not the new content's
    (dest / "config.json.incomplete").write_bytes(b"{" + b"x" * 40)
    done = fetch(str(source), str(dest))
    assert done.returncode == 0, done.stdout + done.stderr
    assert tree(dest) == expected_files(source)


def test_a_local_failure_ends_in_one_fatal_line(checkpoint: Path, tmp_path: Path) -> None:
    """A destination that is a file, or a link to nothing; a negative --retries: tracebacks before."""
    (tmp_path / "a-file").write_text("x")
    done = fetch(str(checkpoint), str(tmp_path / "a-file"))
    assert done.returncode == 1 and "fatal:" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert str(tmp_path / "a-file") in done.stderr
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    done = fetch(str(checkpoint), str(tmp_path / "dangling"))
    assert done.returncode == 1 and "fatal:" in done.stderr and "Traceback" not in done.stderr, done.stderr
    negative = fetch(str(checkpoint), str(tmp_path / "n"), "--retries", "-1")
    assert negative.returncode == 2 and "--retries" in negative.stderr


def test_a_directory_source_follows_links_and_refuses_a_dangling_one(
    checkpoint: Path, tmp_path: Path
) -> None:
    """A linked subdirectory was skipped and a dangling link left out, silently ("done")."""
    source, elsewhere = tmp_path / "source", tmp_path / "elsewhere"
    source.mkdir()
    elsewhere.mkdir()
    _copy_tree(checkpoint, source)
    (elsewhere / "tokenizer-extra.json").write_text("{}")
    (source / "linked").symlink_to(elsewhere, target_is_directory=True)
    done = fetch(str(source), str(tmp_path / "out"), "--include", "*")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "out" / "linked" / "tokenizer-extra.json").read_text() == "{}"
    (source / "model-00002-of-00002.safetensors").symlink_to(tmp_path / "nowhere")
    dangling = fetch(str(source), str(tmp_path / "out2"), "--include", "*")
    assert dangling.returncode == 1 and "model-00002-of-00002.safetensors" in dangling.stderr, dangling.stderr
    assert "a link to nothing" in dangling.stderr


def test_a_directory_and_a_link_to_it_are_both_copied_and_a_loop_ends(
    checkpoint: Path, tmp_path: Path
) -> None:
    """With `a/` and a link `b -> a`, the copy held only one of them (which, by the listing's order): a real
    path vanished. Both are copied now, as `cp -rL` copies them; a link back up is not followed into a loop."""
    source = tmp_path / "source"
    source.mkdir()
    _copy_tree(checkpoint, source)
    for name in ("a", "z"):
        (source / name).mkdir()
        (source / name / "extra.json").write_text(f'{{"{name}": 1}}')
    (source / "b").symlink_to("a", target_is_directory=True)
    (source / "y").symlink_to("z", target_is_directory=True)
    (source / "a" / "up").symlink_to("..", target_is_directory=True)
    done = fetch(str(source), str(tmp_path / "out"), "--include", "*")
    assert done.returncode == 0, done.stdout + done.stderr
    out = tmp_path / "out"
    for copy, name in (("a", "a"), ("b", "a"), ("z", "z"), ("y", "z")):
        assert (out / copy / "extra.json").read_text() == f'{{"{name}": 1}}', copy
    assert not (out / "a" / "up").exists()  # the loop's way back up is where it ends
