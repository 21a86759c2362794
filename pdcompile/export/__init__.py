"""Export and load: a pipeline as a folder of readable files, and back, without pickle.

`write.export_pipeline` (behind `Pipeline.export`) writes the folder, `read.load_pipeline`
(behind `pdcompile.load`) reads it back; `files` checks a folder without loading it, `source`
writes a stage module as Python, and `callable_ref`, `module_record` and `optimizer_recipe`
record what would otherwise be pickled (by `import_paths`); `user_modules` keeps a copy of a
user's model file whose code they name.

    stage_<i>.py            the stage module's Python source (class Stage<i>, torch.fx code)
    stage_<i>.safetensors   its parameters and buffers
    stage_<i>_modules.safetensors  only for submodules that cannot be written as source: their
                            structure (class by import path, attributes) as JSON
    optimizer_<i>.safetensors  the stage's optimizer state (momentum, Adam moments, ...)
    rank_<r>.py             the generated loop of rank r (the code `load` runs)
    plan.json               the Plan; schedule.txt: the lowered schedule
    pipeline.json           everything else `load` needs (stage inputs/outputs, ties, names), the
                            loss function by import path and each stage's optimizer as its class,
                            defaults and param groups (optimizer_recipe), and the input shapes
                            a graph from torch.export runs on (passes/input_shapes.py)
    graph.py, graph_modules.safetensors  the traced model's code (structure only; best effort)
    example.safetensors     the example minibatch (inputs, target): `pdcompile run`'s default data
    user_code/<module>.py   only for `pdcompile export FILE.py:factory`: a copy of FILE.py, whose
                            loss_fn (or functions the stage code imports) pipeline.json names;
                            its SHA-256 is in pipeline.json and `load` imports this copy
    launch.sh, README.md    how to run it on several processes (`pdcompile run`)
    MANIFEST.json, MANIFEST.sig  every file's size and SHA-256, and the writer's signature
    .export.lock            held while the folder is written (one writer at a time)

Nothing is unpickled at load: tensors come from safetensors files and the rest from JSON, so a
data file from elsewhere can hold wrong numbers but runs no code. The `.py` files are code, as
in any Python package: `load` imports them (and the modules the JSON names by import path, as
their `import` lines would), so load an export only from someone whose code you would run.
"""

