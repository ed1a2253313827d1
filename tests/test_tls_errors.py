"""TLS files that cannot serve are refused at start in one line naming the file and what is wrong with it
(a garbage key, a key of another certificate, a garbage CA bundle, ...), not with gRPC's failed bind that
blames the port. Missing files and files that are not PEM keep their own one-line errors."""

from __future__ import annotations

import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from cli_procs import run_cli

from hicache.config import ConfigError
from hicache.service.preflight import check_tls

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")

GARBAGE = "-----BEGIN {0}-----\nbm90IGEgcmVhbCB7MH0gYXQgYWxs\n-----END {0}-----\n"


def _openssl(d: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a server certificate it signed and its key, a key of another certificate, an encrypted copy of
    the server's key, and PEM files with garbage inside."""
    d = tmp_path_factory.mktemp("pki")
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl(d, "req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=test-ca")
    _openssl(d, "req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost")
    _openssl(d, "x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "server.pem", "-days", "2")
    _openssl(d, "req", "-x509", *ec, "-keyout", "other.key", "-out", "other.pem", "-days", "2", "-subj", "/CN=other")
    _openssl(d, "pkey", "-in", "server.key", "-aes256", "-passout", "pass:secret", "-out", "encrypted.key")
    (d / "garbage.key").write_text(GARBAGE.format("PRIVATE KEY"))
    (d / "garbage.pem").write_text(GARBAGE.format("CERTIFICATE"))
    return d


def test_matching_files_pass(pki: Path) -> None:
    check_tls(str(pki / "server.pem"), str(pki / "server.key"), str(pki / "ca.pem"))
    check_tls(str(pki / "server.pem"), str(pki / "server.key"))


# (cert, key, client CA) -> (field, file named, what is said)
CASES = {
    "garbage-key": (("server.pem", "garbage.key", ""), ("serve.tls_key", "garbage.key", "no private key")),
    "key-of-another-cert": (("server.pem", "other.key", ""),
                            ("serve.tls_key", "other.key", "does not belong to the certificate in")),
    "garbage-ca": (("server.pem", "server.key", "garbage.pem"), ("serve.tls_client_ca", "garbage.pem",
                                                                  "no CA certificate")),
    "garbage-cert": (("garbage.pem", "server.key", ""), ("serve.tls_cert", "garbage.pem", "no certificate")),
    "key-as-cert": (("server.key", "server.key", ""), ("serve.tls_cert", "server.key", "no certificate")),
    "encrypted-key": (("server.pem", "encrypted.key", ""), ("serve.tls_key", "encrypted.key", "encrypted")),
    "ca-is-a-key": (("server.pem", "server.key", "ca.key"), ("serve.tls_client_ca", "ca.key", "no CA certificate")),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_file_is_named_with_its_fault(case: str, pki: Path) -> None:
    (cert, key, ca), (field, named, said) = CASES[case]
    with pytest.raises(ConfigError) as e:
        check_tls(str(pki / cert), str(pki / key), str(pki / ca) if ca else "")
    msg = str(e.value)
    assert e.value.field == field and msg.startswith(f"{field}: {pki / named}: "), msg
    assert said in msg and "\n" not in msg, msg


def test_missing_and_non_pem_files_keep_their_errors(pki: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^serve\.tls_key: .*none\.key: No such file"):
        check_tls(str(pki / "server.pem"), str(tmp_path / "none.key"))
    (tmp_path / "text.pem").write_text("not a certificate\n")
    with pytest.raises(ConfigError, match=r"^serve\.tls_client_ca: .*text\.pem: not a PEM file"):
        check_tls(str(pki / "server.pem"), str(pki / "server.key"), str(tmp_path / "text.pem"))


CLI_CASES = ["garbage-key", "key-of-another-cert", "garbage-ca"]


def test_hicache_serve_refuses_them_in_one_line_before_binding(pki: Path) -> None:
    """The command as an operator runs it: exit 2, one line on stderr naming the file, no word of a port."""

    def run(case: str) -> tuple[str, subprocess.CompletedProcess[str]]:
        (cert, key, ca), _ = CASES[case]
        args = ["serve", "--port", "0", "--metrics-port", "0", "--l1-tokens", "4096", "--l2-tokens", "0",
                "--no-shared-pool", "--tls-cert", str(pki / cert), "--tls-key", str(pki / key)]
        if ca:
            args += ["--tls-client-ca", str(pki / ca)]
        return case, run_cli(args, timeout_s=25)

    with ThreadPoolExecutor(len(CLI_CASES)) as pool:
        results = list(pool.map(run, CLI_CASES))
    for case, r in results:
        _, (field, named, said) = CASES[case]
        assert r.returncode == 2, f"{case}: exit {r.returncode}\n{r.stderr[-2000:]}"
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert len(lines) == 1, f"{case}: {r.stderr}"
        assert lines[0].startswith(f"hicache serve: config: {field}: {pki / named}: "), lines[0]
        assert said in lines[0] and "bind" not in lines[0] and "port" not in lines[0], lines[0]
