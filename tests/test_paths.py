"""nibble's folders: the cache (models, kernels) and the data (chats), and the variables that move them."""
from nibble.formats import paths


def test_nibble_home_holds_the_cache_and_the_data(monkeypatch, tmp_path):
    monkeypatch.setenv("NIBBLE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg-data"))
    assert paths.cache_home() == paths.data_home() == tmp_path / "home"
    assert paths.models_dir() == tmp_path / "home" / "models"
    assert paths.kernels_dir() == tmp_path / "home" / "numba"


def test_nibble_home_may_start_with_a_tilde(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("NIBBLE_HOME", "~/nibble")
    assert paths.cache_home() == paths.data_home() == tmp_path / "nibble"


def test_without_nibble_home_the_xdg_folders_then_the_home_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("NIBBLE_HOME", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg-data"))
    assert paths.cache_home() == tmp_path / "xdg-cache" / "nibble"
    assert paths.data_home() == tmp_path / "xdg-data" / "nibble"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert paths.cache_home() == tmp_path / "user" / ".cache" / "nibble"
    assert paths.data_home() == tmp_path / "user" / ".local" / "share" / "nibble"
    assert paths.models_dir() == tmp_path / "user" / ".cache" / "nibble" / "models"


def test_computing_a_path_creates_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("NIBBLE_HOME", str(tmp_path / "home"))
    paths.cache_home(), paths.data_home(), paths.models_dir(), paths.kernels_dir()
    assert list(tmp_path.iterdir()) == []
