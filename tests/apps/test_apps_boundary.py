"""The apps (command line, demo, bundled data/models/layers) sit on top of the core: no
module outside ``keras_noisecurve.apps`` imports them, and the package's lazy names do
not reach into them except through the ``apps`` submodule itself."""

from __future__ import annotations

from tests.test_layout import PACKAGE, _imports, _modules

APPS = f"{PACKAGE}.apps"


def test_core_never_imports_the_apps():
    modules = _modules()
    assert APPS in modules and f"{APPS}.strategy_table" in modules
    offenders = []
    for module in sorted(modules):
        if module == APPS or module.startswith(APPS + "."):
            continue
        offenders += [f"{module} -> {target}" for target in sorted(_imports(module, modules))
                      if target == APPS or target.startswith(APPS + ".")]
    assert not offenders, "core modules import the apps:\n" + "\n".join(offenders)


def test_the_apps_import_edges_are_seen():
    # the check above would pass vacuously if no edge into the apps were found at all
    modules = _modules()
    assert f"{APPS}.layers" in _imports(f"{APPS}.models", modules)
    assert f"{APPS}.strategy_table" in _imports(f"{APPS}.cli_solve", modules)


def test_package_exports_name_no_app_module():
    import keras_noisecurve

    assert all(not target.startswith(APPS) for target in keras_noisecurve._EXPORTS.values())
    assert "apps" in keras_noisecurve._SUBMODULES
    assert not {"cli", "layers", "models", "data", "demo"} & set(keras_noisecurve._SUBMODULES)
