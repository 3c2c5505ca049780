"""Command line: ``travelator generate | serve | bench``."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from travelator.bench.cli import add_bench_parser
from travelator.default_model import resolve_model
from travelator.engine_args import add_engine_args, engine_kwargs
from travelator.sim.cli import add_simulate_parser


def cmd_generate(args: argparse.Namespace) -> int:
    from travelator import LLM, SamplingParams

    llm = LLM(resolve_model(args), **engine_kwargs(args))
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        max_tokens=args.max_tokens, seed=args.seed_sampling, stop=args.stop or [],
        ignore_eos=args.ignore_eos,
    )
    prompts = args.prompt or ["Once upon a time"]
    if llm.get_tokenizer().chat_template is not None and not args.no_chat_template:
        # An instruct model: each prompt is a user message; its answer is printed alone.
        results = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
        shown = ["" for _ in prompts]
    else:
        results = llm.generate(prompts, params, use_tqdm=False)
        shown = prompts
    for prefix, result in zip(shown, results):
        out = result.outputs[0]
        print(prefix + out.text)
        print(f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]", file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from travelator import LLM
    from travelator.engine.async_engine import AsyncEngine
    from travelator.server.app import build_app
    from travelator.server.auth import is_loopback
    from travelator.server.run import run_server
    from travelator.sampling_params import StopLimits
    from travelator.scoring import ScoreFormat
    from travelator.server.settings import ServerSettings

    if args.data_parallel_size > 1:
        from travelator.replicas.launch import serve_replicas

        return serve_replicas(args, args.argv[args.argv.index("serve") + 1:])
    model = resolve_model(args)
    settings = ServerSettings(
        served_model_names=args.served_model_name or [model],
        api_key=args.api_key if args.api_key is not None else os.environ.get("TRAVELATOR_API_KEY"),
        max_waiting=args.max_waiting, max_n=args.max_n, max_body_bytes=args.max_body_bytes,
        stop_limits=StopLimits(args.max_stop_strings, args.max_stop_string_chars, args.max_stop_token_ids),
        priority_range=(args.priority_range[0], args.priority_range[1]),
        shutdown_grace_s=args.shutdown_grace, allowed_origins=args.allowed_origins,
        allowed_methods=args.allowed_methods, allowed_headers=args.allowed_headers,
        grammar_compile_timeout_s=args.grammar_compile_timeout, max_constraint_bytes=args.max_constraint_bytes,
        tool_call_parser=args.tool_call_parser, pooling=args.pooling, json_number_digits=args.json_number_digits,
        json_exponent_digits=args.json_exponent_digits,
        score_format=ScoreFormat(args.score_template, tuple(args.score_labels.split(","))),
        response_store_max_count=args.response_store_max_count,
        response_store_max_bytes=args.response_store_max_bytes, response_store_ttl_s=args.response_store_ttl,
        dashboard=not args.no_dashboard, dashboard_show_prompts=args.dashboard_show_prompts,
    )
    if args.enable_debug_endpoints:
        settings.enable_debug_endpoints = True
    if args.step_timeout is not None:
        settings.step_timeout_s = args.step_timeout
    settings.validate()
    if args.disaggregate is not None:
        from travelator.disagg.frontend import DisaggConfig, DisaggregatedFrontEnd
        from travelator.engine_args import engine_config

        from travelator.engine.tp_launch import launch_env

        disagg = DisaggConfig.parse(args.disaggregate)
        disagg.threads_per_worker = args.worker_threads
        disagg.launch = launch_env()  # under torchrun: rank 0 serves, the others run workers
        if disagg.launch is not None and disagg.launch.rank != 0:
            from travelator.disagg.hosts import serve_worker_rank

            return serve_worker_rank(disagg, disagg.launch)
        client = DisaggregatedFrontEnd(engine_config(model, **engine_kwargs(args)), disagg)
        layout = f"; {disagg.num_prefill} prefill and {disagg.num_decode} decode workers"
    else:
        client = AsyncEngine(LLM(model, **engine_kwargs(args)).engine)
        layout = ""
    app = build_app(client, settings)
    auth = "API key required" if settings.api_key else "no API key (use --api-key to require one)"
    print(f"serving {', '.join(settings.served_model_names)} on http://{args.host}:{args.port}/v1 "
          f"(context {client.served_model.max_model_len} tokens{layout}; {auth})", file=sys.stderr, flush=True)
    if settings.dashboard and args.disaggregate is None:
        print(f"live view: http://{args.host}:{args.port}/dashboard", file=sys.stderr, flush=True)
        if settings.api_key is None and not is_loopback(args.host):
            logging.getLogger(__name__).warning(
                "listening on %s without an API key: the live view answers clients on this machine "
                "only (403 to others); start with --api-key to show it to them", args.host)
    return run_server(app, args.host, args.port, log_level=args.log_level.lower(),
                      access_log=args.access_log)


def cmd_export_tokenizer(args: argparse.Namespace) -> int:
    from travelator.model.loader import open_model

    source = open_model(args.model)
    source.tokenizer.save_pretrained(args.directory, model_max_length=source.arch.max_position_embeddings)
    print(f"wrote {args.directory}/tokenizer.json and tokenizer_config.json: "
          f"transformers.AutoTokenizer.from_pretrained({str(args.directory)!r}) loads it", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="travelator", description=__doc__)
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for prompts, offline")
    add_engine_args(gen)
    gen.add_argument("prompt", nargs="*", help='default: "Once upon a time"')
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed-sampling", type=int, default=None, help="sampling seed")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--no-chat-template", action="store_true",
                     help="continue each prompt as raw text even when the model has a chat template "
                          "(default with a template: each prompt is a user message and the "
                          "assistant's answer is printed; models without one always continue text)")
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_engine_args(srv)
    srv.add_argument("--host", default="127.0.0.1", help="default: 127.0.0.1 (this machine only)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on /v1 (default: $TRAVELATOR_API_KEY)")
    srv.add_argument("--served-model-name", nargs="+", default=None,
                     help="model names clients may ask for (default: the --model value)")
    srv.add_argument("--max-waiting", type=int, default=None,
                     help="requests allowed to wait for the engine; past it 503 (default: no limit)")
    srv.add_argument("--max-n", type=int, default=16, help="most choices per prompt (default 16)")
    srv.add_argument("--max-body-bytes", type=int, default=4 << 20,
                     help="largest request body; past it 413 (default 4 MiB)")
    srv.add_argument("--max-stop-strings", type=int, default=64,
                     help="most stop strings per request; past it 400 (default 64)")
    srv.add_argument("--max-stop-string-chars", type=int, default=256,
                     help="longest stop string, in characters; past it 400 (default 256)")
    srv.add_argument("--max-stop-token-ids", type=int, default=64,
                     help="most stop_token_ids per request; past it 400 (default 64)")
    srv.add_argument("--priority-range", type=int, nargs=2, default=[-1000, 1000], metavar=("LOW", "HIGH"),
                     help="the priorities clients may ask for; others get 400 (default -1000 1000)")
    srv.add_argument("--shutdown-grace", type=float, default=10.0,
                     help="seconds in-flight requests get to finish after SIGTERM before they are aborted")
    srv.add_argument("--access-log", action="store_true", help="log every HTTP request")
    srv.add_argument("--allowed-origins", nargs="+", default=[], metavar="ORIGIN",
                     help="CORS: origins browsers may call from, e.g. https://ui.example or '*' "
                          "(default: none, no CORS headers)")
    srv.add_argument("--allowed-methods", nargs="+", default=["*"], metavar="METHOD",
                     help="CORS: allowed methods when some origin is allowed (default: *)")
    srv.add_argument("--allowed-headers", nargs="+", default=["*"], metavar="HEADER",
                     help="CORS: allowed request headers when some origin is allowed (default: *)")
    srv.add_argument("--grammar-compile-timeout", type=float, default=10.0,
                     help="seconds a request's output constraint (JSON schema, regex, grammar, forced "
                          "tool call) may take to compile; past it the request gets a 400 (default 10)")
    srv.add_argument("--max-constraint-bytes", type=int, default=256 << 10,
                     help="largest output constraint compiled, as sent (JSON schema, regex, grammar, forced "
                          "tool call); past it the request gets a 400 before any work (default 262144)")
    srv.add_argument("--json-number-digits", type=int, default=17,
                     help="most digits of a number in a JSON-constrained output (response_format, forced "
                          "tool calls), integer and fraction parts together (default 17)")
    srv.add_argument("--json-exponent-digits", type=int, default=3,
                     help="most digits of a number's exponent in a JSON-constrained output (default 3)")
    srv.add_argument("--tool-call-parser", choices=["auto", "hermes", "llama3_json"], default="auto",
                     help="how tool calls are read out of the text with tool_choice auto: Hermes "
                          "<tool_call> tags or Llama 3 JSON (default: auto, from the chat template)")
    srv.add_argument("--pooling", choices=["last", "mean"], default="last",
                     help="/v1/embeddings: the last prompt token's final hidden state, or the mean "
                          "over every prompt token (normalised to unit length; default last)")
    srv.add_argument("--score-template", default=None, metavar="TEXT",
                     help="/v1/score and /v1/rerank: the prompt, with {query} and {document} in it "
                          "(default: the chat template asking whether the document meets the query)")
    srv.add_argument("--score-labels", default="yes,no", metavar="YES,NO",
                     help="/v1/score and /v1/rerank: the label tokens after the prompt; the score is "
                          "the first one's probability among them (default yes,no)")
    srv.add_argument("--response-store-max-count", type=int, default=1000,
                     help="most responses kept for previous_response_id and GET /v1/responses/{id}, "
                          "least recently used out first (default 1000; 0: none)")
    srv.add_argument("--response-store-max-bytes", type=int, default=64 << 20,
                     help="most bytes (as JSON) of stored responses in all (default 67108864)")
    srv.add_argument("--response-store-ttl", type=float, default=3600.0,
                     help="seconds a stored response is kept (default 3600)")
    srv.add_argument("--no-dashboard", action="store_true",
                     help="do not serve the live view (GET /dashboard and its stream /dashboard/stream)")
    srv.add_argument("--dashboard-show-prompts", action="store_true",
                     help="let the live view show the first 200 characters of each prompt (off: only "
                          "ids and token counts)")
    srv.add_argument("--enable-debug-endpoints", action="store_true",
                     help="serve GET /debug/engine (block pool and request accounting); "
                          "also TRAVELATOR_DEBUG_ENDPOINTS=1")
    srv.add_argument("--step-timeout", type=float, default=None,
                     help="seconds after which a step that has not returned marks the engine stuck "
                          "(503 on /health, server exits 1); also TRAVELATOR_STEP_TIMEOUT_S")
    srv.add_argument("--disaggregate", default=None, metavar="P:D",
                     help="prefill/decode disaggregation: P prefill and D decode worker processes, each "
                          "with its own engine and KV pool; the KV of each prompt moves from a prefill "
                          "to a decode worker over gloo (e.g. 1:2; default: one engine); under torchrun "
                          "--nnodes N the workers are dealt out over the ranks and rank 0 serves")
    srv.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                     help="N replicas, each a whole engine in its own process on its own share of the "
                          "cores, behind this one endpoint; requests go where their prefix went "
                          "before, else to the least loaded replica (default 1)")
    srv.add_argument("--worker-threads", type=int, default=None,
                     help="with --disaggregate: torch threads per worker (default: the cores shared out; "
                          "placed by Ray, 1), the CPUs of its bundle under --distributed-executor-backend ray")
    srv.set_defaults(func=cmd_serve)

    exp = sub.add_parser("export-tokenizer",
                         help="write the model's tokenizer as a directory transformers loads")
    exp.add_argument("model", help="HF-layout directory or .gguf file")
    exp.add_argument("directory", help="where to write tokenizer.json and tokenizer_config.json")
    exp.set_defaults(func=cmd_export_tokenizer)

    add_bench_parser(sub)
    add_simulate_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
