"""Reading DeepSpeed ZeRO checkpoints and writing consolidated safetensors, one tensor at a time.

No Lightning imports here: the Lightning callback and the command-line tool are thin layers over this package.

* :mod:`.torch_zip` reads the structure of ``torch.save`` files without loading tensor data or running pickled code.
* :mod:`.locate` finds the tag directory and the per-rank files of a checkpoint.
* :mod:`.zero_reader` maps every tensor of the model onto the byte ranges in the rank files that hold it.
* :mod:`.lightning_file_reader` does the same for the ``state_dict`` of a single-file Lightning checkpoint.
* :mod:`.plan` chooses the exported keys (prefix, frozen parameters, tied weights) and their dtype.
* :mod:`.safetensors_writer` streams tensors into safetensors shards inside a staging directory.
* :mod:`.exporter` ties these together; :mod:`.live` exports a running DeepSpeed engine; :mod:`.loading` loads
  an export back into a module.

Its errors are :class:`~lightspeed.core.errors.CheckpointError` and :class:`~lightspeed.core.errors.ExportError`.
"""
