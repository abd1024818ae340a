"""No secret of a storage URL reaches an error message, a log line or describe()."""

from __future__ import annotations

import logging

import pytest

from kvtier.storage import open_backend, redact_url

PASSWORD = "hunter2"


@pytest.mark.parametrize(
    "url",
    [
        f"ftp://:{PASSWORD}@host/x",  # unknown scheme
        f":{PASSWORD}@host:6379",  # no scheme at all
        f"redis://:{PASSWORD}@",  # no host
        f"redis://:{PASSWORD}@host:notaport",
        f"redis://user:{PASSWORD}@host:99999",
        f"redis://user:{PASSWORD}@host/x",  # bad db
        f"redis://:{PASSWORD}@host?bogus=1",
        f"redis://:{PASSWORD}@host?password={PASSWORD}",
        f"rediss://:{PASSWORD}@host?timeout=abc",
        f"redis+cluster://:{PASSWORD}@h1:1,h2:x",
        f"redis://:{PASSWORD}@h1:1,h2:2",  # several hosts without +cluster
        f"redis://{PASSWORD}@host",  # no ':' in the credentials
        f"mooncake://user:{PASSWORD}@host:50051",
        f"mooncake://:{PASSWORD}@host",
        f"mooncake://host:1?metadata=http://u:{PASSWORD}@etcd:2&bogus=1",
        f"memory://?capacity=1GiB&password={PASSWORD}",
        f"file://user:{PASSWORD}@host/dir",
        f"file:///tmp/x?password={PASSWORD}",
        f"redis://:{PASSWORD}@host?throttle=fast",
    ],
)
def test_a_bad_url_error_never_shows_the_password(url):
    with pytest.raises(ValueError) as err:
        open_backend(url)
    assert PASSWORD not in str(err.value)


@pytest.mark.parametrize("password", ["hun/ter2", "hun?ter2", "hun#ter2", "hun@ter2"])
def test_a_password_with_raw_delimiters_is_never_shown_in_part(password):
    with pytest.raises(ValueError) as err:
        open_backend(f"redis://:{password}@host:notaport")
    assert "hun" not in str(err.value) and "ter2" not in str(err.value)


@pytest.mark.parametrize(
    "url,shown",
    [
        ("redis://:s3cret@host:6379/0", "redis://:***@host:6379/0"),
        ("redis://bob:s3:cret@host", "redis://bob:***@host"),
        ("redis://s3cret@host", "redis://***@host"),
        ("redis://host?password=s3cret&timeout=2", "redis://host?password=***&timeout=2"),
        ("memory://?auth_token=s3cret", "memory://?auth_token=***"),
        ("file:///pools/a@b?capacity=1GiB", "file:///pools/a@b?capacity=1GiB"),  # a path, not credentials
        ("mooncake://m:1?protocol=tcp", "mooncake://m:1?protocol=tcp"),
    ],
)
def test_redact_url_hides_passwords_and_keeps_the_rest(url, shown):
    assert redact_url(url) == shown


def test_describe_and_failure_logs_hide_the_password(caplog):
    from kvtier.storage import StorageClient

    backend = open_backend(f"redis://bob:{PASSWORD}@127.0.0.1:1/0?timeout=0.2")  # nothing listens
    client = StorageClient(backend, retries=0)
    with caplog.at_level(logging.WARNING):
        assert client.lookup_prefix([b"k" * 32]) == 0  # a failed call, logged
    assert "bob:***@127.0.0.1:1" in backend.describe()
    assert PASSWORD not in backend.describe() + str(client.stats()) + caplog.text
    assert "failed on redis://bob:***@" in caplog.text
    client.close()
