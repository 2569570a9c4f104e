"""HFDataLoader / BaseDataLoader contract: order, give-back, epochs, resume, bad rows."""

from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path

import datasets
import pytest

from nexrl.data import (
    HFDataLoader,
    InMemoryDataLoader,
    create_dataloader,
)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def five(tmp_path: Path) -> Path:
    rows = [{"prompt": f"p{i}", "answer": str(i)} for i in range(5)]
    return write_jsonl(tmp_path / "d.jsonl", rows)


def drain(loader, n: int | None = None) -> list[dict]:
    out = []
    while n is None or len(out) < n:
        item = loader.get_next_item()
        if item is None:
            break
        out.append(item)
    return out


def test_validation_loader_one_pass_in_order_then_reset(five: Path) -> None:
    loader = HFDataLoader({"path": str(five)}, is_validate=True)
    assert len(loader) == 5 and not loader.is_finished() and loader.can_return_item()
    items = drain(loader)
    assert [it["prompt"] for it in items] == [f"p{i}" for i in range(5)]
    assert [it["index"] for it in items] == list(range(5))
    assert items[0]["answer"] == "0" and items[0]["uid"] == "val-0-0"
    assert loader.get_next_item() is None
    assert loader.is_finished() and not loader.can_return_item() and len(loader) == 0
    loader.add_item_back({"prompt": "late"})
    assert not loader.is_finished()
    loader.reset()  # drops returned items, rewinds
    assert [it["prompt"] for it in drain(loader)] == [f"p{i}" for i in range(5)]


def test_returned_items_are_served_first_front_before_back(five: Path) -> None:
    loader = HFDataLoader({"path": str(five), "shuffle": False, "num_epochs": 1})
    a, b = loader.get_next_item(), loader.get_next_item()
    loader.add_item_back(a)
    loader.add_item({"prompt": "x"})  # add_item == add_item_back
    loader.add_item_front(b)
    assert len(loader) == 3 + 3
    got = [it["prompt"] for it in drain(loader)]
    assert got == ["p1", "p0", "x", "p2", "p3", "p4"]


def test_epochs_shuffle_each_epoch_and_uids_unique(five: Path) -> None:
    loader = HFDataLoader({"path": str(five), "num_epochs": 3, "seed": 7})
    assert len(loader) == 15
    items = drain(loader)
    assert len(items) == 15 and loader.is_finished()
    for e in range(3):
        assert sorted(it["index"] for it in items[5 * e : 5 * e + 5]) == list(range(5))
    assert len({it["uid"] for it in items}) == 15
    assert {it["uid"] for it in items[:5]} == {f"0-{i}" for i in range(5)}
    orders = [tuple(it["index"] for it in items[5 * e : 5 * e + 5]) for e in range(3)]
    assert len(set(orders)) > 1  # reshuffled per epoch
    again = HFDataLoader({"path": str(five), "num_epochs": 3, "seed": 7})
    assert [it["uid"] for it in drain(again)] == [it["uid"] for it in items]  # deterministic


def test_training_loader_cycles_forever_by_default(five: Path) -> None:
    loader = HFDataLoader({"path": str(five)})
    items = drain(loader, 12)
    assert len(items) == 12 and not loader.is_finished()
    assert loader.epoch == 2 and len(loader) == 3  # remaining in the current epoch
    assert Counter(it["index"] for it in items[:10]) == Counter({i: 2 for i in range(5)})


def test_state_dict_resumes_exactly(five: Path) -> None:
    cfg = {"path": str(five), "seed": 3}
    a = HFDataLoader(cfg)
    first = drain(a, 7)
    a.add_item_front(first[2])
    state = json.loads(json.dumps(a.state_dict()))  # survives a JSON round trip
    b = HFDataLoader(cfg)
    b.load_state_dict(state)
    assert [it["uid"] for it in drain(b, 11)] == [it["uid"] for it in drain(a, 11)]
    other = HFDataLoader({**cfg, "seed": 4})
    with pytest.raises(ValueError, match="seed"):
        other.load_state_dict(state)


def test_max_items_and_getitem(five: Path) -> None:
    loader = HFDataLoader({"path": str(five), "max_items": 2, "num_epochs": 1, "shuffle": False})
    assert loader.num_rows == 2 and len(drain(loader)) == 2
    assert loader[1]["prompt"] == "p1"
    with pytest.raises(IndexError):
        loader[2]


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        ([{"prompt": "a"}, {"prompt": "b"}, {"answer": "c"}], r"row 2: missing key 'prompt'"),
        ([{"prompt": "a"}, {"prompt": 5}], r"row 1: 'prompt' must be a str"),
        ([{"prompt": "a"}, {"prompt": ""}], r"row 1: 'prompt' is an empty string"),
        ([{"question": "a"}], r"row 0: missing key 'prompt'"),
    ],
)
def test_malformed_rows_name_file_and_row(tmp_path: Path, rows: list[dict], match: str) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ValueError, match=match) as info:
        HFDataLoader({"path": str(path)})
    assert str(path) in str(info.value)


def test_invalid_json_line_names_the_row(tmp_path: Path) -> None:
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b"}\nnot json\n')
    with pytest.raises(ValueError, match=r"row 2 \(line 3\) is not valid JSON"):
        HFDataLoader({"path": str(path)})


def test_chat_message_prompts_are_accepted(tmp_path: Path) -> None:
    rows = [{"prompt": [{"role": "user", "content": "hi"}]}]
    loader = HFDataLoader({"path": str(write_jsonl(tmp_path / "c.jsonl", rows))})
    assert loader.get_next_item()["prompt"] == [{"role": "user", "content": "hi"}]


def test_parquet_and_saved_dataset_directory(tmp_path: Path) -> None:
    ds = datasets.Dataset.from_dict({"q": ["a", "b", "c"], "answer": ["1", "2", "3"]})
    ds.to_parquet(str(tmp_path / "d.parquet"))
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "dd"))
    pq = HFDataLoader({"path": str(tmp_path / "d.parquet"), "prompt_key": "q"}, is_validate=True)
    assert [it["q"] for it in drain(pq)] == ["a", "b", "c"]
    saved = HFDataLoader(
        {"path": str(tmp_path / "dd"), "split": "test", "prompt_key": "q"}, is_validate=True
    )
    assert [it["answer"] for it in drain(saved)] == ["1"]
    with pytest.raises(ValueError, match="splits"):
        HFDataLoader({"path": str(tmp_path / "dd"), "split": "nope", "prompt_key": "q"})


def test_concurrent_readers_get_each_item_once(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "big.jsonl", [{"prompt": f"p{i}"} for i in range(400)])
    loader = HFDataLoader({"path": str(path), "num_epochs": 1})
    seen: list[str] = []
    lock = threading.Lock()

    def reader() -> None:
        while (item := loader.get_next_item()) is not None:
            if item["index"] % 7 == 0 and not item.get("returned"):
                loader.add_item_back({**item, "returned": True})  # give some back
                continue
            with lock:
                seen.append(item["uid"])

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 400 and len(set(seen)) == 400 and loader.is_finished()


def test_registry_and_import_path(five: Path) -> None:
    assert type(create_dataloader({"type": "hf", "path": str(five)})) is HFDataLoader
    assert type(create_dataloader({"type": "torch", "path": str(five)})) is HFDataLoader
    mem = create_dataloader({"type": "nexrl.data:InMemoryDataLoader", "items": [{"prompt": "a"}]})
    assert isinstance(mem, InMemoryDataLoader)
    assert mem.get_next_item() == {"prompt": "a", "index": 0, "uid": "0-0"}
    assert mem.is_finished()
    with pytest.raises(ValueError, match="valid choices"):
        create_dataloader({"type": "nope", "path": str(five)})
    with pytest.raises(ValueError, match="does not exist"):
        create_dataloader({"path": str(five) + ".missing"})


def test_struct_dictconfig_sections_are_accepted(five: Path) -> None:
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"type": "hf", "path": str(five), "seed": 0, "num_epochs": 1})
    OmegaConf.set_struct(cfg, True)  # unknown keys raise on attribute access
    assert len(drain(create_dataloader(cfg))) == 5
    mem = OmegaConf.create({"type": "memory", "items": [{"prompt": "a", "meta": {"k": 1}}]})
    OmegaConf.set_struct(mem, True)
    assert create_dataloader(mem).get_next_item()["meta"] == {"k": 1}


def test_arithmetic_task_is_chat_prompts_with_disjoint_held_out_questions(tmp_path):
    import json

    from nexrl.data.tasks import write_task

    train, val = write_task("arithmetic", tmp_path, n_train=200, n_val=50, seed=1)
    rows = [json.loads(x) for x in train.read_text().splitlines()]
    held = [json.loads(x) for x in val.read_text().splitlines()]
    assert len(rows) == 200 and len(held) == 50
    questions = {r["prompt"][0]["content"] for r in rows}
    assert not questions & {r["prompt"][0]["content"] for r in held}
    for row in rows + held:
        (msg,) = row["prompt"]
        a, op, b = msg["content"].split("?")[0].removeprefix("What is ").split()
        assert msg["role"] == "user" and 10 <= int(a) <= 99 and 10 <= int(b) <= 99
        assert int(row["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b))


def test_times_tables_task_covers_the_tables_with_a_held_out_part(tmp_path):
    import json

    from nexrl.data.tasks import write_task

    train, val = write_task("times_tables", tmp_path)
    rows = [json.loads(x) for x in train.read_text().splitlines()]
    held = [json.loads(x) for x in val.read_text().splitlines()]
    assert len(rows) == 81 and len(held) == 40
    pairs = set()
    for row in rows + held:
        a, op, b = row["prompt"][0]["content"].split("?")[0].removeprefix("What is ").split()
        assert op == "*" and 2 <= int(a) <= 12 and 2 <= int(b) <= 12
        assert int(row["answer"]) == int(a) * int(b)
        pairs.add((int(a), int(b)))
    assert len(pairs) == 121  # every question once: train and held-out are disjoint
    with pytest.raises(ValueError, match="exceeds the 121 questions"):
        write_task("arithmetic", tmp_path, n_train=100, n_val=22, ops="*", operands=(2, 12))


def _row_by_row(ds: datasets.Dataset, item: dict) -> dict:
    """What the loader hands out for `item`'s row, read from the table by itself."""
    return {**ds[item["index"]], "index": item["index"], "uid": item["uid"]}


@pytest.mark.parametrize("fmt", [None, "numpy"])
def test_rows_read_in_blocks_equal_rows_read_one_by_one(tmp_path: Path, fmt) -> None:
    # 150 rows: blocks of 64 end mid-epoch and the last one is short; 2.5 epochs cross
    # two epoch boundaries, where the order (and so every block) changes
    ds = datasets.Dataset.from_dict(
        {
            "prompt": [f"p{i}" for i in range(150)],
            "answer": list(range(150)),
            "tags": [[i, -i] for i in range(150)],
        }
    )
    if fmt:
        ds = ds.with_format(fmt)  # a saved dataset keeps its format: read row by row
    ds.save_to_disk(str(tmp_path / "saved"))
    loader = HFDataLoader({"path": str(tmp_path / "saved"), "seed": 5})
    table = loader._dataset
    items = drain(loader, 375)
    for item in items:
        got, want = item, _row_by_row(table, item)
        assert got.keys() == want.keys()
        assert all(str(got[k]) == str(want[k]) for k in want), (got, want)
    for epoch in range(3):
        order = [it["index"] for it in items if it["uid"].startswith(f"{epoch}-")]
        assert order == [int(i) for i in loader._permutation(epoch)][: len(order)]
        assert len(order) == (150 if epoch < 2 else 75)


def test_a_resumed_or_reset_loader_reads_its_new_position(tmp_path: Path) -> None:
    rows = [{"prompt": f"p{i}", "answer": str(i)} for i in range(100)]
    cfg = {"path": str(write_jsonl(tmp_path / "d.jsonl", rows)), "seed": 1}
    a = HFDataLoader(cfg)
    drain(a, 70)  # mid second block
    state = a.state_dict()
    b = HFDataLoader(cfg)
    drain(b, 10)  # b has read its own first block
    b.load_state_dict(state)
    assert [it["uid"] for it in drain(b, 50)] == [it["uid"] for it in drain(a, 50)]
    b.reset()
    fresh = HFDataLoader(cfg)
    assert drain(b, 80) == drain(fresh, 80)


def test_mock_and_memory_loaders_from_the_data_section_hold_its_rows(five: Path) -> None:
    from nexrl.config.schema import DataConfig

    for kind in ("mock", "memory"):
        loader = create_dataloader(DataConfig(type=kind, path=str(five)))
        assert type(loader) is InMemoryDataLoader
        assert [it["prompt"] for it in drain(loader)] == [f"p{i}" for i in range(5)]
