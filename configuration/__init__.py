"""One configuration for the worker, the client library, the CLI and the gateway.

Every setting has one place it is declared (a settings class's field, naming its variable) and
one order its value is looked for in: a value given in code or on the command line, then its
variable, then a file, then its default. An empty variable counts as unset. Credentials come
only from the environment, never from a file. docs/configuration.md lists every variable.

    values.py      the value types and in-variable formats, shared with the files' models
    pools.py       PoolConfig: a pool the worker may run jobs on
    codec_keys.py  the payload codec's key ring and its variables' names
    errors.py      the production file's and the codec's errors (bad S3 settings raise
                   workflows.errors' StorageConfigError, a storage error)
    files.py       the production file (DURABLE_COMFY_SETTINGS_FILE) and the dev stack file's
                   worker section (DURABLE_COMFY_CONFIG): reading and checking them
    sources.py     the source order, written once: `Settings`, the base of every settings class
    settings.py    every settings class the worker, the client, the CLI and the gateway read
    processes.py   what each process reads at its start (WorkerConfig, CliConfig, GatewayConfig)

Nothing here imports the worker's, the client's or the gateway's code: each of them imports
this package. The RunPod handler's image has its own settings (endpoint/settings.py): it has no
Temporal, no workflows/ and none of this.
"""
