"""The workers' room: Ray gradient actors, clipping engines, models, data sources and Poisson sampling."""

from workers.lazy import public_face

__getattr__, __dir__, __all__ = public_face(__name__, {
    "actor": ["GradientWorkerActor", "retain_freed_memory"],
    "clipping": ["LayerClipNorms", "clip_factors"],
    "data": ["DATASETS", "dataset_size", "load_split", "write_atomically"],
    "engines": ["ExampleSchema", "clipped_sum", "synthetic_examples"],
    "features": ["compute_features", "feature_map"],
    "fingerprints": ["dataset_identity"],
    "keys": ["NOISE", "SecretKey", "process_key"],
    "collective": ["CollectiveRankActor", "ShardCollectiveRankActor", "slice_bounds"],
    "models": ["bind_flat_views", "build_model", "flat_parameters", "load_flat_parameters", "parameter_count"],
    "noise": ["CHUNK_VALUES", "COUNT_NOISE", "GRADIENT_NOISE", "SECURE_DRAWS", "TREE_NOISE", "GaussianNoise",
              "chunk_bounds", "driver_threads", "fill_unit_normal"],
    "names": ["ENGINE_NAMES", "LOSS_NAMES", "MODEL_NAMES", "PRECISIONS", "check_metrics", "task_of"],
    "optimizers": ["torch_optimizer"],
    "planned_batches": ["MAX_WINDOW_STEPS", "WINDOW_BYTES", "PlannedBatch", "PlannedWindows", "auto_window_steps",
                        "first_row", "gather_window", "private_window_folder", "read_planned_batch",
                        "remove_window_folder", "window_plan"],
    "reducer": ["NodeReducerActor"],
    "sampling": ["cyclic_poisson_batch", "fixed_order_batch", "make_generator", "poisson_sample", "shuffled_order",
                 "step_generator"],
    "shard_worker": ["ShardWorkerActor"],
    "shard_spec": ["ShardSpec"],
    "sources": ["BUILTINS", "DataError", "DroppedRows", "LENIENT_FORMATS", "PARQUET_SUFFIXES", "SPLITS",
                "SplitSchema", "check_source", "dropped_rows", "parse_spec", "read_features", "read_first",
                "select_blocks", "source_size", "spec_name", "split_schema", "training_table", "write_parquet_shards"],
    "tasks": ["build_loss", "build_transform"],
    "users": ["UserSpec", "user_index"],
    "validation": ["check_model", "unchanged_buffers"],
    "vmap_engine": ["microbatch_clipped_sum", "per_example_clipped_sum"],
})
