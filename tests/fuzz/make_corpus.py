#!/usr/bin/env python3
"""Writes the fuzz targets' seed corpora, tests/fuzz/corpus/<target>/.

    tests/fuzz/make_corpus.py [CAPTURES_DIR]     (default: ../shared/spec/captures)

Request bodies come from the real SDK captures (the spec's captures/*/NNN_*.json,
body_b64_on_wire); what the captures lack (safetensors files, adapter_config.json,
a TTL body) is written here and named synth-*. Each corpus dir is rewritten
whole, so the committed files are exactly this script's output. It also writes
<target>.dict (libFuzzer dictionaries: the words the decoders look for). Needs the
`zstd` command for the compressed forward_backward bodies.

Input formats (see each target's .cpp):
  json:             one byte (the index of the decoder in json_fuzz.cpp's
                    kDecoders, read from that file) + the body
  forward_backward: an uncompressed protobuf ForwardBackwardRequest
  zstd:             one mode byte (0 decompress, 1 round trip, 2 forward_backward) + data
  safetensors:      a whole .safetensors file
  adapter_config:   the text of an adapter_config.json
"""
import base64
import glob
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def decoder_names():
    src = open(os.path.join(HERE, "json_fuzz.cpp")).read()
    table = src[src.index("const Decoder kDecoders[] = {"):]
    table = table[: table.index("\n};")]
    return re.findall(r'^\s*\{"([^"]+)",', table, re.M)


class Corpus:
    """One target's seed dir; identical inputs are written once."""

    def __init__(self, name):
        self.dir = os.path.join(HERE, "corpus", name)
        shutil.rmtree(self.dir, ignore_errors=True)
        os.makedirs(self.dir)
        self.seen = set()

    def add(self, name, data):
        digest = hashlib.sha1(data).digest()
        if digest in self.seen:
            return
        self.seen.add(digest)
        with open(os.path.join(self.dir, name), "wb") as f:
            f.write(data)


def captures(root):
    """(tag, request dict, body bytes) for every captured request, in order."""
    for path in sorted(glob.glob(os.path.join(root, "*", "[0-9]*_*.json"))):
        run = os.path.basename(os.path.dirname(path)).split("-")[0]
        seq = os.path.basename(path).split("_")[0]
        req = json.load(open(path))["request"]
        body = base64.b64decode(req.get("body_b64_on_wire") or "")
        yield f"{run}-{seq}", req, body


def header(req, name):
    return [v for k, v in req["headers"] if k.lower() == name]


def unzstd(data):
    return subprocess.run(["zstd", "-d", "-c", "-q"], input=data, capture_output=True, check=True).stdout


def zstd(data):
    return subprocess.run(["zstd", "-3", "-c", "-q"], input=data, capture_output=True, check=True).stdout


def safetensors(tensors, metadata=None):
    """tensors: [(name, dtype, shape, raw bytes)] -> file bytes (8-byte aligned header)."""
    head, data = {}, b""
    for name, dtype, shape, raw in tensors:
        head[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    if metadata:
        head["__metadata__"] = metadata
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return struct.pack("<Q", len(text)) + text + data


def f32(*v):
    return struct.pack(f"<{len(v)}f", *v)


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(REPO, "..", "shared", "spec", "captures")
    names = decoder_names()
    index = {n: i for i, n in enumerate(names)}
    route = {"client/dynamic_config": "client/config"}  # same decoder

    js, fb, zs = Corpus("json"), Corpus("forward_backward"), Corpus("zstd")
    for tag, req, body in captures(root):
        endpoint = req["path"].removeprefix("/api/v1/")
        if req["method"] == "GET":
            q = dict(req["query"])
            if "limit" in q:
                js.add(f"{tag}-page_params", bytes([index["page_params"]]) + f"{q['limit']}&{q.get('offset', '')}".encode())
            continue
        if endpoint == "forward_backward":
            if header(req, "content-encoding") == ["zstd"]:
                zs.add(f"{tag}-decompress", b"\0" + body)
                zs.add(f"{tag}-forward_backward", b"\2" + body)
                fb.add(f"{tag}-unzstd", unzstd(body))
            else:
                fb.add(tag, body)
            continue
        endpoint = route.get(endpoint, endpoint)
        if endpoint not in index:
            continue  # auth/token: no decoder
        js.add(f"{tag}-{endpoint.replace('/', '_')}", bytes([index[endpoint]]) + body)
        zs.add(f"{tag}-roundtrip", b"\1" + body)
        # Strings the bodies carry that loom decodes on their own.
        doc = json.loads(body or b"{}")
        for key in ("path", "tinker_path", "model_path"):
            v = doc.get(key)
            if isinstance(v, str) and v.startswith("tinker://"):
                js.add(f"{tag}-tinker_path", bytes([index["tinker_path"]]) + v.encode())
                run, ckpt = v.removeprefix("tinker://").split("/", 1)
                js.add(f"{tag}-checkpoint_id", bytes([index["checkpoint_id"]]) + run.encode() + b"\0" + ckpt.encode())
            elif key == "path" and isinstance(v, str):
                js.add(f"{tag}-checkpoint_name", bytes([index["checkpoint_name"]]) + v.encode())

    # Not in the captures (the SDK's REST calls that take a body).
    js.add("synth-checkpoint_ttl", bytes([index["checkpoint ttl"]]) + b'{"ttl_seconds": 3600}')
    js.add("synth-checkpoint_ttl-null", bytes([index["checkpoint ttl"]]) + b'{"ttl_seconds": null}')
    js.add("synth-assign_project", bytes([index["assign_project"]]) + b'{"project_id": "project-1"}')
    zs.add("synth-two-frames", b"\0" + zstd(b'{"a": 1}') + zstd(b'{"b": 2}'))

    st = Corpus("safetensors")
    st.add("synth-f32", safetensors([("w", "F32", [2, 3], f32(1, 2, 3, 4, 5, 6))], {"format": "pt"}))
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    st.add("synth-peft-adapter", safetensors([(f"{q}.lora_A.weight", "F32", [1, 4], f32(0.5, -1, 2, 0)),
                                              (f"{q}.lora_B.weight", "F32", [4, 1], f32(0, 0, 0, 0))],
                                             {"format": "pt"}))
    st.add("synth-dtypes", safetensors([
        ("bf16", "BF16", [3], b"\x80\x3f\x00\x40\x40\x40"),
        ("f16", "F16", [0], b""),
        ("f64", "F64", [1, 1], struct.pack("<d", 2.5)),
        ("i64", "I64", [2], struct.pack("<2q", -1, 7)),
        ("i32", "I32", [1], struct.pack("<i", 3)),
        ("bool", "BOOL", [2, 2], b"\0\1\1\0"),
        ("u8", "U8", [], b"\xff"),
    ]))
    st.add("synth-empty", safetensors([]))

    ac = Corpus("adapter_config")
    # What loom's SavePeft writes.
    ac.add("synth-loom", (json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": "Qwen/Qwen3-8B", "r": 8,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"],
        "bias": "none", "lora_dropout": 0.0, "fan_in_fan_out": False, "inference_mode": True,
        "init_lora_weights": True, "use_rslora": False, "use_dora": False, "modules_to_save": None,
        "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
        "revision": None, "lora_alpha": 16}, indent=2) + "\n").encode())
    # The shape PEFT's save_pretrained writes (more fields, a set as a list).
    ac.add("synth-peft", json.dumps({
        "alpha_pattern": {}, "auto_mapping": None, "base_model_name_or_path": "Qwen/Qwen3-4B", "bias": "none",
        "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True, "layer_replication": None,
        "layers_pattern": None, "layers_to_transform": None, "loftq_config": {}, "lora_alpha": 32,
        "lora_dropout": 0.05, "megatron_config": None, "megatron_core": "megatron.core", "modules_to_save": None,
        "peft_type": "LORA", "r": 16, "rank_pattern": {}, "revision": None, "target_modules": ["v_proj", "q_proj"],
        "task_type": "CAUSAL_LM", "use_dora": False, "use_rslora": False}, indent=2).encode())
    ac.add("synth-float-alpha", b'{"r": 4, "lora_alpha": 12.5, "target_modules": ["down_proj", "lm_head"]}')
    ac.add("synth-minimal", b'{"r": 1, "lora_alpha": 1, "target_modules": []}')

    # Dictionaries: the keys and words each decoder looks for, read from its source.
    words = {
        "json": ["src/wire/json_api.cpp", "src/wire/sample.cpp", "src/wire/json_fields.cpp"],
        "adapter_config": ["src/engine/io/peft_config.cpp"],
        "safetensors": ["src/engine/io/safetensors.cpp"],
    }
    for name, sources in words.items():
        found = set()
        for src in sources:
            found |= set(re.findall(r'"([A-Za-z_][A-Za-z0-9_]*)"', open(os.path.join(REPO, src)).read()))
        with open(os.path.join(HERE, f"{name}.dict"), "w") as f:
            f.write(f"# Written by make_corpus.py from {', '.join(sources)}.\n")
            for w in sorted(found):
                f.write(f'"\\"{w}\\""\n')
            for tok in ("tinker://", "{", "}", "[", "]", ":", ",", "null", "true", "false", "-1", "1e308"):
                f.write('"' + tok.replace('"', '\\"') + '"\n')

    total = 0
    for name in ("json", "forward_backward", "zstd", "safetensors", "adapter_config"):
        d = os.path.join(HERE, "corpus", name)
        files = os.listdir(d)
        size = sum(os.path.getsize(os.path.join(d, f)) for f in files)
        total += size
        print(f"corpus/{name}: {len(files)} files, {size} bytes")
    print(f"total {total} bytes")


if __name__ == "__main__":
    main()
