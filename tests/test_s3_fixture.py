import fsspec


def test_moto_server_speaks_s3_over_http(s3_bucket, s3_options):
    fs = fsspec.filesystem("s3", **s3_options)
    fs.pipe(f"{s3_bucket}/hello.bin", b"\x00\x01abc")
    assert fs.cat(f"{s3_bucket}/hello.bin") == b"\x00\x01abc"
    assert s3_options["client_kwargs"]["endpoint_url"].startswith("http://127.0.0.1:")
