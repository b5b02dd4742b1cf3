"""DockerSandbox.read_file's parsing of the daemon's tar stream, without a daemon: a file
that shrinks or changes while the daemon copies it leaves a stream cut short, which must
end as a SandboxFileError (the sandbox's error family), never a tarfile error."""

from __future__ import annotations

import io
import tarfile

import pytest

from sandbox import SandboxFileError
from sandbox.docker import file_from_archive

CONTENT = bytes(range(256)) * 40  # 10,240 bytes: a header block, 20 data blocks, padding


def _archive(name: str = "out.txt", content: bytes = CONTENT) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        member = tarfile.TarInfo(name)
        member.size = len(content)
        tar.addfile(member, io.BytesIO(content))
    return buffer.getvalue()


def test_a_whole_archive_yields_the_file() -> None:
    assert file_from_archive(_archive(), "out.txt", 1 << 20) == CONTENT


@pytest.mark.parametrize("kept_bytes", [0, 100, 512, 512 + 4000, 512 + len(CONTENT) - 1])
def test_an_archive_cut_short_is_a_sandbox_file_error(kept_bytes: int) -> None:
    truncated = _archive()[:kept_bytes]
    with pytest.raises(SandboxFileError, match="changed while it was read"):
        file_from_archive(truncated, "out.txt", 1 << 20)


def test_a_corrupt_header_is_a_sandbox_file_error() -> None:
    archive = bytearray(_archive())
    archive[148:156] = b"garbage!"  # the header checksum
    with pytest.raises(SandboxFileError, match="changed while it was read"):
        file_from_archive(bytes(archive), "out.txt", 1 << 20)


def test_a_file_that_grew_past_the_limit_is_refused() -> None:
    with pytest.raises(SandboxFileError, match="limit"):
        file_from_archive(_archive(), "out.txt", len(CONTENT) - 1)
