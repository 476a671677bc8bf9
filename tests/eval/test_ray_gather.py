"""``eval.sessions.ray_rollout``'s gathering of every node's captures into RUN_DIR/captures/<node>/ (issue 37), on
stand-in proxy actors: a capture file already there is never replaced. The round itself runs in test_ray_rollout.py."""

from types import SimpleNamespace

from eval.sessions import ray_rollout

NODE = "a" * 40  # a Ray node id; its folder is named by the first 16 characters


def proxy(files: dict[str, bytes]) -> SimpleNamespace:
    """A stand-in CaptureProxy handle: ``finish.remote()`` gives ``files`` (ray.get is patched to pass it on)."""
    return SimpleNamespace(finish=SimpleNamespace(remote=lambda: files))


def test_gathering_keeps_a_capture_file_already_there_and_writes_the_new_one_beside_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ray_rollout.ray, "get", lambda ref: ref)
    node_folder = tmp_path / ray_rollout.CAPTURES / NODE[:16]
    node_folder.mkdir(parents=True)
    (node_folder / "capture-x.jsonl").write_bytes(b"an earlier round's record\n")
    (node_folder / "capture-same.jsonl").write_bytes(b"this round's record\n")
    files = {
        "capture-x.jsonl": b"this round's other record\n",
        "capture-same.jsonl": b"this round's record\n",  # the same bytes: kept as it is, not copied again
        "capture-y.jsonl": b"a new file\n",
    }

    ray_rollout._gather_captures({NODE: proxy(files)}, {NODE: "http://127.0.0.1:1"}, tmp_path / ray_rollout.CAPTURES)

    assert {p.name: p.read_bytes() for p in node_folder.iterdir()} == {
        "capture-x.jsonl": b"an earlier round's record\n",
        "capture-x-1.jsonl": b"this round's other record\n",
        "capture-same.jsonl": b"this round's record\n",
        "capture-y.jsonl": b"a new file\n",
    }
    err = capsys.readouterr().err
    assert f"{node_folder / 'capture-x.jsonl'} holds other bytes" in err
    assert str(node_folder / "capture-x-1.jsonl") in err
