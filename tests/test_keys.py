"""Page keys: chained, namespaced, cryptographic, stable across processes (golden vectors pin the format)."""

import hashlib
import struct
import subprocess
import sys

import numpy as np
import pytest

from hicache.keys import KeyChain, Namespace, page_keys, tokens_to_bytes
from hicache.layout import KVLayout

LAYOUT = KVLayout(32, 8, 128, "bfloat16", 4)
NS = Namespace("meta-llama/Llama-3.1-8B", LAYOUT, revision="0e9e39f")

GOLDEN_NS = "02bbf0958c73aa4871d2f3f6648ef25d693674a191db03f8198826e6a46401d9"
GOLDEN_KEYS = [
    "271c51efb4007f457a2cb1e5e32b64ea1718714c9b62fcbf32bbf9f705bb9f95",
    "52793c92c1658723d2fac8a2ea834c8a65337271e08f17dbea54a6fdb913af3a",
]
GOLDEN_TENANT_ACME = "19a7dcf08c9b8b1e2ae3e59f0486c88f137fee30b205b2e9ef96ef21a0d28e4b"


def test_golden_vectors() -> None:
    assert NS.digest.hex() == GOLDEN_NS
    keys = page_keys(NS, list(range(10)))  # 2 full pages of 4; the partial third page has no key
    assert [k.hex() for k in keys] == GOLDEN_KEYS
    assert page_keys(NS.with_tenant("acme"), [0, 1, 2, 3])[0].hex() == GOLDEN_TENANT_ACME


def test_chain_definition_matches_an_independent_computation() -> None:
    prev = hashlib.sha256(NS.describe().encode()).digest()
    tokens = list(range(100, 112))
    expected = []
    for i in range(3):
        prev = hashlib.sha256(prev + struct.pack("<4I", *tokens[4 * i : 4 * i + 4])).digest()
        expected.append(prev)
    assert page_keys(NS, tokens) == expected


def test_keys_equal_in_another_process() -> None:
    code = (
        "from hicache.keys import Namespace, page_keys; from hicache.layout import KVLayout;"
        "ns = Namespace('meta-llama/Llama-3.1-8B', KVLayout(32, 8, 128, 'bfloat16', 4), revision='0e9e39f');"
        "print(','.join(k.hex() for k in page_keys(ns, list(range(1000, 1064)))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "12345", "PATH": ""}).stdout.strip()
    assert out.split(",") == [k.hex() for k in page_keys(NS, list(range(1000, 1064)))]


@pytest.mark.parametrize(
    "other",
    [
        Namespace("meta-llama/Llama-3.1-8B", LAYOUT, revision="other-weights"),
        Namespace("other-model", LAYOUT, revision="0e9e39f"),
        Namespace("meta-llama/Llama-3.1-8B", KVLayout(32, 8, 128, "float16", 4), revision="0e9e39f"),
        Namespace("meta-llama/Llama-3.1-8B", KVLayout(32, 8, 128, "bfloat16", 8), revision="0e9e39f"),
        Namespace("meta-llama/Llama-3.1-8B", KVLayout(32, 1, 128, "bfloat16", 4, "mla"), revision="0e9e39f"),
        Namespace("meta-llama/Llama-3.1-8B", LAYOUT, revision="0e9e39f", tp_rank=1, tp_size=2),
        Namespace("meta-llama/Llama-3.1-8B", LAYOUT, revision="0e9e39f", tenant="t2"),
    ],
)
def test_every_namespace_field_changes_every_key(other: Namespace) -> None:
    toks = list(range(64))
    a, b = page_keys(NS, toks), page_keys(other, toks)
    assert not set(a) & set(b)


def test_key_names_the_whole_prefix() -> None:
    a = page_keys(NS, [1, 2, 3, 4, 5, 6, 7, 8])
    b = page_keys(NS, [9, 2, 3, 4, 5, 6, 7, 8])
    assert a[1] != b[1]  # same second page, different first page


def test_token_validation() -> None:
    for bad in ([-1], [2**32], np.array([1.5])):
        with pytest.raises(ValueError, match="tokens"):
            tokens_to_bytes(bad)
    assert tokens_to_bytes(np.array([1, 2], dtype=np.int64)) == tokens_to_bytes([1, 2])
    assert tokens_to_bytes((2**32 - 1,)) == b"\xff\xff\xff\xff"


def test_key_chain_extends_incrementally() -> None:
    chain = KeyChain(NS)
    toks = list(range(30))
    chain.extend(toks[:9])
    assert chain.extend(toks) == page_keys(NS, toks)


def test_namespace_validation() -> None:
    with pytest.raises(ValueError, match="model"):
        Namespace("", LAYOUT)
    with pytest.raises(ValueError, match="tp_rank"):
        Namespace("m", LAYOUT, tp_rank=2, tp_size=2)
