"""One frozen config dataclass per component, grouped under `KVRelayConfig`.

The field defaults are the CLI defaults: `kvrelay.cli` builds its flags from these fields
(name `max_kv_tokens` becomes `--max-kv-tokens`, help from `metadata["help"]`). Values
discovered at run time (page count, EOS ids, context length) live in runtime objects,
never here.
"""
from __future__ import annotations

from dataclasses import dataclass, field


def _f(default, help: str, **extra):
    return field(default=default, metadata={"help": help, **extra})


def _require(ok: bool, message: str) -> None:
    """Config errors are ValueErrors whose message says what to fix in one line."""
    if not ok:
        raise ValueError(message)


DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class ModelOptions:
    model: str = _f(DEFAULT_MODEL, "model to serve: the built-in default, a .gguf file, a Hugging Face "
                    "directory (config.json + *.safetensors + tokenizer), a Hugging Face id (owner/name) "
                    "already in the local Hugging Face cache, or random:<config.json>")
    dtype: str = _f("auto", "compute and KV dtype; auto: bfloat16 where the CPU computes it natively "
                    "(AVX-512 BF16), else float32 with the weights stored as bfloat16 (docs/performance.md)",
                    choices=("auto", "float32", "bfloat16"))
    kernels: str = _f("auto", "native kernel variant: auto picks the best this CPU runs (cpuid) unless "
                      "KVRELAY_ISA names one; a variant the CPU lacks is refused; torch runs no native kernels",
                      choices=("auto", "avx512_bf16", "avx512_vnni", "avx2", "torch"))
    # Its choices are auto and the names in the registry.
    attention_backend: str = _f("auto", "attention over the KV cache: cpu_native (the native CPU kernels), "
                                "torch_ref (plain torch on any device, the reference), cuda (Triton kernels on a "
                                "CUDA device); auto: cpu_native on a CPU where the native kernels run, cuda on a "
                                "CUDA device, else torch_ref (KVRELAY_ATTENTION_BACKEND replaces auto)",
                                choices=("auto",), registry="kvrelay.engine.attention:ATTENTION_BACKENDS")
    quantization: str = _f("none", "weights kept quantized: int8 (per output channel) or int4 (per group) "
                           "quantized at load, or gguf (the file's own Q8_0/Q4_0/Q4_1 blocks)",
                           choices=("none", "int8", "int4", "gguf"))
    quant_group_size: int = _f(32, "int4: weights per scale along the input dimension")
    lm_head_quantization: str = _f("auto", "how the output head (lm_head, or the embedding tied to it) is "
                                   "kept; auto: int8 under --quantization int8 or int4, the file's own blocks "
                                   "under gguf, as the other weights otherwise; none: float, as the other "
                                   "weights would be without --quantization; int8 or int4: quantized at load",
                                   choices=("auto", "none", "int8", "int4"))
    device: str = _f("cpu", "where the model, its KV pool and sampling live: cpu, or cuda (the first visible "
                     "GPU; CUDA_VISIBLE_DEVICES picks it), which runs no native CPU kernels",
                     choices=("cpu", "cuda"))
    served_model_name: str | None = _f(None, "model name reported by the API (default: derived from --model)")
    seed: int = _f(0, "seed for random-weight models")


KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "int8", "fp8_e4m3")


@dataclass(frozen=True)
class KVCacheConfig:
    page_size: int = _f(16, "tokens per KV page")
    max_kv_tokens: int | None = _f(None, "KV capacity in tokens (overrides --kv-cache-gb)")
    kv_cache_gb: float = _f(1.0, "KV capacity in GiB when --max-kv-tokens is not given")
    kv_cache_dtype: str = _f("auto", "how the KV cache stores keys and values: auto (bfloat16 where --dtype auto "
                             "computes float32, on a CPU without AVX-512 BF16: half the bytes each decode step "
                             "reads; else the compute dtype), bfloat16, float32 (with --dtype float32 only), or "
                             "8-bit with a float32 scale per token and head (about half the bytes per token of "
                             "bfloat16); prefill and decode workers must agree",
                             choices=KV_CACHE_DTYPES)

    def __post_init__(self) -> None:
        _require(self.page_size >= 1, "--page-size must be at least 1")
        _require(self.max_kv_tokens is None or self.max_kv_tokens >= 1, "--max-kv-tokens must be at least 1")
        _require(self.kv_cache_gb > 0, "--kv-cache-gb must be positive")
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES, f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}")


QUEUE_ORDERS = ("fcfs", "shortest-first")


CORE_SHARE_SLOTS = 64


def core_share_spec(spec: str) -> tuple[str, int]:
    """--core-share FILE:SLOT -> (file, slot); a ValueError saying what to fix otherwise."""
    path, sep, slot = spec.rpartition(":")
    _require(bool(sep and path and slot.isdigit() and int(slot) < CORE_SHARE_SLOTS),
             f"--core-share must be FILE:SLOT with SLOT from 0 to {CORE_SHARE_SLOTS - 1}, not {spec!r}")
    return path, int(slot)


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int = _f(64, "most requests in the running batch")
    max_prefill_tokens: int = _f(4096, "prompt tokens per prefill step")
    max_model_len: int | None = _f(None, "longest prompt + completion (default: the model's context)")
    target_tpot: float = _f(0.0, "mixed batches: seconds a decode step may take while prompts are prefilled "
                            "in the same forward pass; each step carries every running decode plus a prompt "
                            "chunk sized from the measured per-token costs to fit this (at least 32 tokens, so "
                            "prompts always advance). 0 (the default): a prefill step runs alone and the "
                            "decodes wait for it, which served more requests within SLOs on a 2-core AVX2 CPU "
                            "(docs/performance.md)")
    queue_order: str = _f("fcfs", "which waiting prompt is prefilled next: fcfs (arrival order) or shortest-first "
                          "(fewest prompt tokens left first, so more requests meet a time-to-first-token "
                          "target; one that has waited --max-queue-wait goes ahead of every shorter one, "
                          "in arrival order, so none starves)", choices=QUEUE_ORDERS)
    max_queue_wait: float = _f(2.0, "shortest-first: seconds a waiting prompt may be passed over by shorter ones")
    shed_ttft: float = _f(0.0, "shed load: refuse a new request (503 with Retry-After, code overloaded) when the "
                          "prompt tokens to be prefilled before and with it, at the measured seconds per prompt "
                          "token, predict a time to first token above this many seconds, rather than admit work "
                          "that would miss its target and delay the requests behind it (serve: the router "
                          "does it, from its prefill workers' queues). 0 (the default): never")
    core_share: str | None = _f(None, "FILE:SLOT: share this host's cores with the other engines posting in FILE "
                                "(created if missing; give each engine its own SLOT, 0-63): before each step, the "
                                "engines that have work split the cores evenly and each runs on its part. `kvrelay "
                                "serve` sets it for its workers (--share-cores). Default: a fixed thread count "
                                "(OMP_NUM_THREADS)")
    leave_busy_cores: bool = _f(True, "the cores that other processes keep busy (from 0.6 of one, measured every "
                                "0.5 s from /proc) are left to them: with --core-share the engines posting in the "
                                "file split the rest, otherwise the engine runs on at most the cores they leave free "
                                "(one thread at least): a thread team beside a busy core waits at every barrier. Off: "
                                "every core, whatever else runs")

    def __post_init__(self) -> None:
        if self.core_share is not None:
            core_share_spec(self.core_share)
        _require(self.max_running_requests >= 1, "--max-running-requests must be at least 1")
        _require(self.max_prefill_tokens >= 1, "--max-prefill-tokens must be at least 1")
        _require(self.target_tpot >= 0, "--target-tpot must be 0 (off) or a positive number of seconds")
        _require(self.queue_order in QUEUE_ORDERS, f"--queue-order must be one of {', '.join(QUEUE_ORDERS)}")
        _require(self.max_queue_wait > 0, "--max-queue-wait must be a positive number of seconds")
        _require(self.shed_ttft >= 0, "--shed-ttft must be 0 (off) or a positive number of seconds")
        _require(self.max_model_len is None or self.max_model_len >= 2, "--max-model-len must be at least 2")


@dataclass(frozen=True)
class ServerConfig:
    host: str = _f("127.0.0.1", "address to listen on")
    port: int = _f(8000, "port to listen on")
    log_level: str = _f("info", "log level", choices=("debug", "info", "warning", "error"))
    log_format: str = _f("text", "log lines on stderr, kvrelay's and uvicorn's alike: text (timestamped "
                         "key=value) or json (one object per line)", choices=("text", "json"))
    timeout_keep_alive: float = _f(5.0, "seconds an idle keep-alive HTTP connection is kept open between "
                                   "requests before it is closed")
    header_timeout: float = _f(10.0, "seconds a connection may take, from connecting or from the first byte "
                               "of a request, until that request's headers are complete; a slower one is "
                               "closed (slow or idle clients hold no connection longer)")
    body_timeout: float = _f(30.0, "seconds a request body may go without a byte arriving; then the request "
                             "is answered 408 and its connection closed")
    max_connections: int = _f(4096, "most open HTTP connections; a new one beyond it closes the longest idle "
                              "connection, or is refused (503) when none is idle")
    max_connections_per_client: int = _f(2048, "most open HTTP connections from one client address; a new one "
                                         "beyond it closes that address's longest idle connection, or is "
                                         "refused (503) when none is idle")
    limit_concurrency: int = _f(2048, "most HTTP requests in flight at once (idle connections do not count); "
                                "beyond it new ones get 503 (above the router's 2 x --max-queued-requests legs "
                                "per worker)")
    allowed_origins: tuple[str, ...] = _f((), "origins browsers may call the API from (CORS), e.g. "
                                          "https://app.example.com, or '*' for any; methods GET, POST, OPTIONS; "
                                          "headers Authorization, Content-Type, X-Request-Id (default: none, no "
                                          "CORS headers)", nargs="+")

    def __post_init__(self) -> None:
        _require(0 <= self.port <= 65535, "--port must be between 0 and 65535")
        _require(self.timeout_keep_alive > 0, "--timeout-keep-alive must be positive")
        _require(self.header_timeout > 0, "--header-timeout must be positive")
        _require(self.body_timeout > 0, "--body-timeout must be positive")
        _require(self.max_connections >= 1, "--max-connections must be at least 1")
        _require(self.max_connections_per_client >= 1, "--max-connections-per-client must be at least 1")
        _require(self.limit_concurrency >= 1, "--limit-concurrency must be at least 1")


@dataclass(frozen=True)
class LifecycleConfig:
    heartbeat_interval: float = _f(1.0, "seconds between P<->D heartbeats")
    heartbeat_misses: int = _f(3, "missed heartbeats after which a peer is dead")
    bootstrap_timeout: float = _f(60.0, "backstop for the bootstrap phase, seconds")
    queue_timeout: float = _f(120.0, "backstop for P's queued phase, seconds")
    waiting_timeout: float = _f(120.0, "backstop for D's waiting phase, seconds")
    transfer_timeout: float = _f(60.0, "backstop for P's transfer phase, seconds")
    max_request_time: float | None = _f(None, "optional backstop for D's decode phase, seconds")
    quarantine_grace: float = _f(5.0, "extra seconds a one-sided backend keeps a failed request's "
                                 "pages after the transfer deadline")


@dataclass(frozen=True)
class TransferConfig:
    # Its choices are the names in the registry (one line there adds a backend to the CLI too).
    transfer_backend: str = _f("shm", "KV transfer backend", registry="kvrelay.disagg.transfer:TRANSFER_BACKENDS")
    transfer_host: str = _f("127.0.0.1", "address the transfer endpoint binds and advertises")
    transfer_port: int = _f(0, "port of the transfer endpoint (0: pick a free one; with `serve`, the "
                            "first worker's, the others take the next ports)")
    layerwise_transfer: bool = _f(True, "a prefill worker writes each layer's KV to the decode worker while the "
                                  "prompt's later layers compute (every backend but the fakes' two-sided one); "
                                  "off: the whole KV after the prompt")
    verify_kv: bool = _f(False, "a prefill worker sends a CRC-32 of each request's KV pages with its first token, "
                         "and the decode worker checks its copy before decoding: a mismatch fails the request "
                         "(transfer_error: the router retries it on another pair, if there is one) and is "
                         "logged. Costs a pass over the KV on each side; for suspected corruption, not on by "
                         "default")
    fault_spec: str | None = _f(None, "fault injection spec, e.g. 'drop_ack=1.0;delay_ctrl=0.2' "
                                "(also read from KVRELAY_FAULTS); needs --enable-fault-injection")
    enable_fault_injection: bool = _f(False, "allow --fault-spec, KVRELAY_FAULTS and POST /debug/faults (tests "
                                      "and drills); only with loopback --host and --transfer-host")


@dataclass(frozen=True)
class RouterConfig:
    prefill: tuple[str, ...] = _f((), "prefill worker URLs (http://host:port)", nargs="+")
    decode: tuple[str, ...] = _f((), "decode worker URLs (http://host:port)", nargs="+")
    request_timeout: float = _f(600.0, "end-to-end deadline of one request, seconds")
    max_queued_requests: int = _f(256, "completions the router holds at once (each prompt of a request times "
                                  "its n); a request that does not fit now gets 503, one that could never "
                                  "fit a 400")
    health_interval: float = _f(1.0, "seconds between health checks of each worker")
    health_timeout: float = _f(2.0, "a health check slower than this counts as failed, seconds")
    health_misses: int = _f(3, "a worker that answered no health check for --health-interval x this many "
                            "seconds is dead: every leg the router has open on it fails (peer_failed)")
    shed_ttft: float = _f(0.0, "shed load: refuse a new request (503 with Retry-After, code overloaded) when the "
                          "prefill workers' reported queues predict its first token later than this many "
                          "seconds; 0: off")
    decode_prefill_ttft: float = _f(0.0, "the adaptive P/D split: a request whose first token the prefill "
                                    "workers' queues predict later than this many seconds is prefilled by its "
                                    "decode worker instead (no KV transfer) when that worker predicts it "
                                    "sooner; 0: never")

    def __post_init__(self) -> None:
        _require(self.request_timeout > 0, "--request-timeout must be positive")
        _require(self.max_queued_requests >= 1, "--max-queued-requests must be at least 1")
        _require(self.health_interval > 0, "--health-interval must be positive")
        _require(self.health_timeout > 0, "--health-timeout must be positive")
        _require(self.health_misses >= 1, "--health-misses must be at least 1")
        _require(self.shed_ttft >= 0, "--shed-ttft must be 0 (off) or a positive number of seconds")
        _require(self.decode_prefill_ttft >= 0, "--decode-prefill-ttft must be 0 (off) or a positive number "
                 "of seconds")

    @property
    def health_lease(self) -> float:
        """Seconds without a good health check after which a worker is dead."""
        return self.health_interval * self.health_misses


@dataclass(frozen=True)
class ClusterConfig:
    num_prefill: int = _f(1, "prefill workers `kvrelay serve` starts on this host")
    num_decode: int = _f(1, "decode workers `kvrelay serve` starts on this host")
    worker_threads: int | None = _f(None, "a fixed number of torch threads per worker (default: --share-cores)")
    share_cores: bool = _f(True, "the workers share this host's cores: before each step, those that have work "
                           "split the cores evenly, so a prefill worker computes on every core while its decode "
                           "worker idles (--core-share); --no-share-cores: the cores divided among the workers, "
                           "fixed")
    startup_timeout: float = _f(600.0, "seconds to wait for every worker to become ready")
    worker_base_port: int | None = _f(None, "HTTP port of prefill worker 0: prefill worker i listens on "
                                      "base + i, decode worker j on base + --num-prefill + j "
                                      "(default: --port + 1; 0: any free ports)")
    max_worker_restarts: int = _f(5, "a worker that exits is restarted at its port (after 1 s, doubling up to "
                                  "30 s, a new incarnation); after this many restarts in a row, each dying "
                                  "within a minute of becoming ready, `kvrelay serve` stops and exits non-zero "
                                  "(0: exit at the first worker that dies)")

    def __post_init__(self) -> None:
        _require(self.num_prefill >= 1, "--num-prefill must be at least 1")
        _require(self.num_decode >= 1, "--num-decode must be at least 1")
        _require(self.worker_threads is None or self.worker_threads >= 1, "--worker-threads must be at least 1")
        _require(self.worker_base_port is None or 0 <= self.worker_base_port <= 65535,
                 "--worker-base-port must be between 0 and 65535")
        _require(self.max_worker_restarts >= 0, "--max-worker-restarts must be 0 or more")


@dataclass(frozen=True)
class SecurityConfig:
    cluster_key_file: str | None = _f(None, "file holding the cluster's shared secret (or set KVRELAY_CLUSTER_KEY); "
                                      "every process of one cluster needs the same one, e.g. from `kvrelay "
                                      "keygen`; without a key, workers bind loopback only")
    api_key: tuple[str, ...] = _f((), "API key clients must send as 'Authorization: Bearer KEY' (repeat the "
                                  "flag for several; or set KVRELAY_API_KEY, comma-separated)",
                                  nargs="+", action="extend")
    protect_metrics: bool = _f(False, "require the API key (workers: the cluster token) for /health and /metrics too")
    max_streams_per_key: int = _f(0, "most requests one API key may have in flight at once; beyond it "
                                  "new ones get 429 (0: no per-key limit)")
    ssl_certfile: str | None = _f(None, "serve HTTPS with this certificate (PEM)")
    ssl_keyfile: str | None = _f(None, "the private key of --ssl-certfile (PEM)")
    ssl_ca_certs: str | None = _f(None, "CA bundle (PEM) the router trusts for https:// worker URLs")
    replay_window: float = _f(60.0, "seconds a signed control message stays valid; the clocks of the "
                              "cluster's hosts must agree to well within this")

    def __post_init__(self) -> None:
        _require(self.max_streams_per_key >= 0, "--max-streams-per-key must be 0 or more")
        _require(self.replay_window > 0, "--replay-window must be positive")
        _require((self.ssl_certfile is None) == (self.ssl_keyfile is None),
                 "--ssl-certfile and --ssl-keyfile go together")
        _require(all(k and k.strip() == k for k in self.api_key), "--api-key must not be empty or padded")


@dataclass(frozen=True)
class KVRelayConfig:
    model: ModelOptions = field(default_factory=ModelOptions)
    kv: KVCacheConfig = field(default_factory=KVCacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    lifecycle: LifecycleConfig = field(default_factory=LifecycleConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)


def to_cli_args(section: object) -> list[str]:
    """The flags that reproduce `section`'s non-default values: the inverse of the flags
    `kvrelay.cli` generates from the same fields (`max_kv_tokens` -> `--max-kv-tokens`,
    bools as `--x`/`--no-x`, tuples as one flag with several values). Every optional field
    defaults to None, so a None value is always a default and never needs a flag."""
    from dataclasses import fields

    args: list[str] = []
    for f in fields(section):
        value = getattr(section, f.name)
        if value == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else f"--no-{flag[2:]}")
        elif isinstance(value, tuple):
            args += [flag, *map(str, value)]
        else:
            args += [flag, str(value)]
    return args
