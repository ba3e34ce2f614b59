"""node/shm.py: a container started without --shm-size is told which flag to pass."""


def test_small_dev_shm_gets_a_warning_naming_the_flag(tmp_path, monkeypatch):
    import os

    from node.shm import MIN_SHM_BYTES, shm_warning

    statvfs = os.statvfs
    real = statvfs(tmp_path)

    class Small:
        f_frsize, f_blocks = 4096, (64 << 20) // 4096

    monkeypatch.setattr(os, "statvfs", lambda p: Small if p == "/fake/shm" else statvfs(p))
    text = shm_warning("/fake/shm")
    assert "64 MiB" in text and "--shm-size=2g" in text and "shm_size" in text
    assert shm_warning("/no/such/dir") == ""
    big = real.f_frsize * real.f_blocks >= MIN_SHM_BYTES
    assert (shm_warning(str(tmp_path)) == "") == big
