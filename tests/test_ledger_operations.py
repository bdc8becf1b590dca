"""Each ledger operation as `accounting.ledger.operations` declares it, in every layer: store, client, servicer, CLI.

No server runs. The client's request goes straight to the servicer's method,
and the servicer's call to a recording stand-in for the store, which checks
it against the store's own signature: what a caller gives the client is
what the store is called with. The command line runs in-process with the
same stand-in. Errors go the same way back: each LedgerError the store
raises reaches the client's caller as the same error.
"""

import argparse
import ast
import functools
import inspect
import json
import textwrap

import grpc
import pytest
from prometheus_client import CollectorRegistry

from accounting.events import SampledGaussian
from accounting.ledger import ledger_pb2
from accounting.ledger import client as client_module
from accounting.ledger.admission import check_plan
from accounting.ledger.callers import ADMIN
from accounting.ledger.client import RemoteLedger
from accounting.ledger.errors import BudgetExceeded, InvalidArgument, LedgerError, LedgerUnavailable, RateLimited
from accounting.ledger.limits import TokenBuckets
from accounting.ledger.messages import STATUS_CODES
from accounting.ledger.operations import OPERATIONS, REQUIRED
from accounting.ledger.scheduling import SchedulingPolicy
from accounting.ledger.service import Authenticator, LedgerServicer, rpc_latency_histogram
from accounting.ledger.store import Ledger
from accounting.ledger.validation import check_lease_seconds, check_scheduling
from orchestrator.cli import build_parser, main
import orchestrator.cli.ledger as cli_ledger

# A value for each parameter, none of them its default.
SAMPLES = {
    "tenant": "acme", "key_id": "key-1", "dataset": "acme/mnist", "epsilon": 2.5, "delta": 1e-6,
    "privacy_unit": "user", "scheduling": SchedulingPolicy("dpf", 3, 60.0), "pld_may_be_pending": True,
    "state": "released", "job_id": "job-7", "planned": SampledGaussian(0.01, 1.1, 5), "lease_seconds": 30.0,
    "rows_per_person": 4, "blocks": ("day-1", "day-2"), "reservation_id": "reservation-1", "steps": 3,
    "sequence": 5, "block": "day-1", "data": {"rows": [0, 10]}, "priority": 2, "max_wait_seconds": 90.0,
    "queue_id": "queued-1", "limit": 50, "content": ["a" * 64, "b" * 64], "charges": True, "plan_share": 0.25,
    "plan": "sweep-1", "jobs": [SampledGaussian(0.01, 1.1, 5), SampledGaussian(0.02, 1.3, 7)],
}
# A queued job's state is another set of words than a reservation's.
SAMPLE_OVERRIDES = {("list_queued", "state"): "admitted"}


def sample(operation, name):
    return SAMPLE_OVERRIDES.get((operation, name), SAMPLES[name])


def comparable(name, value):
    """A parameter's value as the store's own checks see it (a plan's JSON, a policy's record, a block's rows)."""
    if value is None:
        return None
    if name == "planned":
        return check_plan(value).to_json()
    if name == "jobs":
        return [check_plan(job).to_json() for job in value]
    if name == "scheduling":
        return check_scheduling(value)
    if name == "data":
        return json.loads(value) if isinstance(value, str) else value
    if name == "blocks":
        return tuple(value)
    return value


class Recorded(Exception):
    """Raised by the recording store once it has the call."""


class RecordingLedger:
    """Stands in for the store: binds each operation's call to `Ledger`'s signature, keeps it, then raises `raises`."""

    def __init__(self, raises=None):
        self.calls = []
        self.raises = raises

    def verified_caller(self, token):
        return ADMIN

    def refuse_while_limited(self, caller):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        return False

    def __getattr__(self, name):
        if name not in OPERATIONS:
            raise AttributeError(name)
        signature = inspect.signature(getattr(Ledger, name))

        def record(*args, **kwargs):
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            self.calls.append((name, {key: value for key, value in bound.arguments.items() if key != "self"}))
            raise self.raises if self.raises is not None else Recorded(name)

        return record


class Aborted(Exception):
    def __init__(self, code, details, trailers):
        super().__init__(code, details)
        self.code, self.details, self.trailers = code, details, trailers


class Context:
    """The servicer's view of one request; `abort` raises, as gRPC's does."""

    def __init__(self):
        self.trailers = ()

    def invocation_metadata(self):
        return (("authorization", "Bearer admin-token-for-tests-0123456789"),)

    def peer(self):
        return "ipv4:127.0.0.1:5000"

    def set_trailing_metadata(self, trailers):
        self.trailers = tuple(trailers)

    def abort(self, code, details):
        raise Aborted(code, details, self.trailers)


class RefusedRpc(grpc.RpcError):
    """What the client's stub raises for a refusal: the status code, its details and the trailing metadata."""

    def __init__(self, aborted):
        self._aborted = aborted

    def code(self):
        return self._aborted.code

    def details(self):
        return self._aborted.details

    def trailing_metadata(self):
        return self._aborted.trailers


def servicer_over(ledger):
    return LedgerServicer(
        ledger, rpc_latency_histogram(CollectorRegistry()), Authenticator(ledger, TokenBuckets(1.0, 20.0, "failures"))
    )


def through_client_and_service(operation, args, kwargs, raises=None):
    """Call the client's method; hand its request to the servicer; the store's recorded call and the abort."""
    sent = []
    client = RemoteLedger("127.0.0.1:1", "admin-token-for-tests-0123456789")

    def send(method, request):
        sent.append((method, request))
        raise Recorded(method)

    client._call = send
    try:
        with pytest.raises(Recorded):
            getattr(client, operation)(*args, **kwargs)
    finally:
        client.close()
    (method, request), = sent
    declared = OPERATIONS[operation]
    assert (method, type(request).__name__) == (declared.rpc, declared.request)
    store = RecordingLedger(raises or NotImplementedError("recorded"))
    with pytest.raises(Aborted) as aborted:
        getattr(servicer_over(store), method)(request, Context())
    if not store.calls:  # refused by the servicer itself
        raise aborted.value
    (name, arguments), = store.calls
    assert name == operation
    return arguments, aborted.value


def store_parameters(operation):
    return list(inspect.signature(getattr(Ledger, operation)).parameters.values())[1:]


@pytest.mark.parametrize("operation", sorted(OPERATIONS))
def test_the_store_and_the_client_take_the_declared_parameters_in_order_with_the_declared_defaults(operation):
    declared = [(parameter.name, parameter.default) for parameter in OPERATIONS[operation].parameters]

    def shape(parameters):
        return [(parameter.name, REQUIRED if parameter.default is inspect.Parameter.empty else parameter.default)
                for parameter in parameters]

    client_parameters = list(inspect.signature(getattr(RemoteLedger, operation)).parameters.values())[1:]
    assert shape(client_parameters) == declared
    assert {parameter.kind for parameter in client_parameters} <= {inspect.Parameter.POSITIONAL_OR_KEYWORD}
    *positional, caller = store_parameters(operation)
    assert shape(positional) == declared
    assert {parameter.kind for parameter in positional} <= {inspect.Parameter.POSITIONAL_OR_KEYWORD}
    # The store's caller is keyword-only: the client's positional arguments never land in it.
    assert (caller.name, caller.kind, caller.default) == ("caller", inspect.Parameter.KEYWORD_ONLY, None)


def test_every_public_method_of_the_client_is_a_declared_operation():
    public = {name for name, _ in inspect.getmembers(RemoteLedger, inspect.isfunction) if not name.startswith("_")}
    assert public - {"close"} == set(OPERATIONS)


def test_the_proto_has_each_operations_rpc_with_its_messages_and_a_field_for_each_parameter():
    methods = ledger_pb2.DESCRIPTOR.services_by_name["Ledger"].methods_by_name
    assert set(methods) == {operation.rpc for operation in OPERATIONS.values()}
    for operation in OPERATIONS.values():
        method = methods[operation.rpc]
        assert (method.input_type.name, method.output_type.name) == (operation.request, operation.reply)
        fields = [name for parameter in operation.parameters for name in parameter.request_fields]
        assert sorted(fields) == sorted(method.input_type.fields_by_name), operation.name
        assert operation.rpc in vars(LedgerServicer), f"the servicer does not answer {operation.rpc}"


@pytest.mark.parametrize("operation", sorted(OPERATIONS))
def test_what_the_client_is_given_the_service_hands_the_store(operation):
    declared = OPERATIONS[operation]
    values = {parameter.name: sample(operation, parameter.name) for parameter in declared.parameters}
    arguments, _ = through_client_and_service(operation, (), values)
    assert arguments.pop("caller") == ADMIN
    assert {name: comparable(name, value) for name, value in arguments.items()} == \
        {name: comparable(name, value) for name, value in values.items()}


@pytest.mark.parametrize("operation", sorted(OPERATIONS))
def test_a_parameter_left_out_at_the_client_reaches_the_store_as_its_declared_default(operation):
    declared = OPERATIONS[operation]
    required = [sample(operation, parameter.name) for parameter in declared.parameters if parameter.default is REQUIRED]
    arguments, _ = through_client_and_service(operation, required, {})
    for parameter in declared.parameters:
        if parameter.default is not REQUIRED:
            assert comparable(parameter.name, arguments[parameter.name]) == \
                comparable(parameter.name, parameter.default), parameter.name


def zero_of(field):
    """The value a request field reads as "not given": "" or 0 (None for an enum, a message or a repeated field)."""
    if field.is_repeated or field.type in (field.TYPE_ENUM, field.TYPE_MESSAGE):
        return None
    return "" if field.type == field.TYPE_STRING else False if field.type == field.TYPE_BOOL else 0


def optional_parameters_and_zeros():
    for operation in OPERATIONS.values():
        fields = ledger_pb2.DESCRIPTOR.message_types_by_name[operation.request].fields_by_name
        for parameter in operation.parameters:
            zero = zero_of(fields[parameter.request_fields[0]])
            if parameter.default is None and zero is not None:
                yield operation.name, parameter.name, zero


@pytest.mark.parametrize("operation, parameter, zero", list(optional_parameters_and_zeros()))
def test_an_optional_parameter_given_its_fields_zero_is_refused_or_reaches_the_store_never_taken_for_its_default(
    operation, parameter, zero
):
    declared = OPERATIONS[operation]
    values = {name.name: sample(operation, name.name) for name in declared.parameters if name.default is REQUIRED}
    values[parameter] = zero
    try:
        arguments, _ = through_client_and_service(operation, (), values)
    except InvalidArgument:  # refused by the client, as the embedded ledger refuses it
        return
    except Aborted as refused:  # refused by the servicer before the store
        assert refused.code == grpc.StatusCode.INVALID_ARGUMENT
        return
    given = check_lease_seconds(zero) if parameter == "lease_seconds" else zero  # 0 s is no lease, in every layer
    assert arguments[parameter] == given


def ledger_error_classes():
    """Every subclass of LedgerError, by name."""
    classes, pending = {}, [LedgerError]
    while pending:
        for subclass in pending.pop().__subclasses__():
            classes[subclass.__name__] = subclass
            pending.append(subclass)
    return classes


def ledger_errors():
    """An instance of every LedgerError subclass."""
    instances = {
        BudgetExceeded: BudgetExceeded("acme/mnist", 0.25, 0.75, 1e-5, "block 'day-1' of dataset 'acme/mnist'"),
        RateLimited: RateLimited("costly requests for acme: retry in 1.5 s", 1.5),
    }
    return [instances.get(error, None) or error(f"{error.__name__} of the store") for error in ledger_error_classes().values()]


def test_every_ledger_error_has_a_status_code():
    assert {type(error) for error in ledger_errors()} <= set(STATUS_CODES)


@pytest.mark.parametrize("error", ledger_errors(), ids=lambda error: type(error).__name__)
def test_a_ledger_error_of_the_store_reaches_the_clients_caller_as_itself(error):
    _, aborted = through_client_and_service("get_budget", ("acme/mnist",), {}, raises=error)
    assert aborted.code == STATUS_CODES[type(error)]
    rebuilt = client_module._ledger_error("127.0.0.1:1", RefusedRpc(aborted))
    assert type(rebuilt) is type(error)
    if not isinstance(error, LedgerUnavailable):  # the client names the server that did not answer
        assert str(rebuilt) == str(error)
    if isinstance(error, BudgetExceeded):
        fields = ("dataset", "remaining_epsilon", "needed_epsilon", "delta", "budget")
        assert [getattr(rebuilt, name) for name in fields] == [getattr(error, name) for name in fields]
    if isinstance(error, RateLimited):
        assert rebuilt.retry_after_seconds == error.retry_after_seconds


def raised_by(function, seen):
    """The LedgerErrors a store method raises itself, or through the store's own methods it calls."""
    if function is None or function in seen or not callable(function):
        return set()
    seen.add(function)
    raised = set()
    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(function)))):
        if isinstance(node, ast.Raise) and node.exc is not None:
            raised_name = (node.exc.func if isinstance(node.exc, ast.Call) else node.exc)
            if isinstance(raised_name, ast.Name) and raised_name.id in ledger_error_classes():
                raised.add(ledger_error_classes()[raised_name.id])
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            raised |= raised_by(inspect.getattr_static(Ledger, node.attr, None), seen)
    return raised


@pytest.mark.parametrize("operation", sorted(OPERATIONS))
def test_the_store_raises_only_the_errors_declared_for_the_operation(operation):
    declared = set(OPERATIONS[operation].errors)
    assert declared <= set(STATUS_CODES)
    assert raised_by(getattr(Ledger, operation), set()) <= declared


@functools.cache
def ledger_parser():
    return build_parser(("ledger",))


def subparser(words):
    """The parser of `dpfleet ledger WORDS...`."""
    parser = ledger_parser()
    for word in ("ledger", *words):
        (commands,) = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
        parser = commands.choices[word]
    return parser


def test_each_commands_options_exist_take_the_declared_defaults_and_give_every_required_parameter():
    for operation in OPERATIONS.values():
        if operation.command is None:
            continue
        actions = {action.dest: action for action in subparser(operation.command.words)._actions}
        given = set(operation.command.options) | set(operation.command.derived)
        required = {parameter.name for parameter in operation.parameters if parameter.default is REQUIRED}
        assert required <= given, operation.name
        assert given <= {parameter.name for parameter in operation.parameters}, operation.name
        named = {*operation.command.options.values(), *(dest for dests in operation.command.derived.values()
                                                        for dest in dests)}
        assert named <= set(actions), operation.name
        for name, dest in operation.command.options.items():
            default = operation.default(name)
            if actions[dest].default is not None and default is not REQUIRED:
                assert actions[dest].default in (default, str(default)), (operation.name, name)


# What the command line needs beside the operation's own options, and what it then hands the store.
CLI_EXTRAS = {
    "create_dataset": (
        ["--scheduling", "dpf", "--unlock-jobs", "3"], {"scheduling": SchedulingPolicy("dpf", 3, None)}
    ),
    "rotate_token": (["--tenant", "acme"], {"tenant": "acme"}),
    "list_jobs": (["--active"], {"state": "active", "charges": True}),
    "list_queued": (["--queued"], {"state": "queued"}),
    "add_block": (["--rows", "0:10"], {"data": {"rows": [0, 10]}}),
}
# The command refuses a tenant and a key id at once.
CLI_LEFT_OUT = {"revoke_token": {"tenant"}}
# The plan of `fits` and the jobs of `plan register` come from a training config, planned as dpfleet train plans it
# (tests/test_ledger_cli.py, tests/test_ledger_plans.py).
CLI_NOT_RUN = {"fits", "register_plan"}


def command_line(operation):
    """`dpfleet ledger ...` words that give each of the operation's options its sample, and the expected call."""
    declared = OPERATIONS[operation]
    actions = {action.dest: action for action in subparser(declared.command.words)._actions}
    positional, optional = [], []
    extra_argv, expected = CLI_EXTRAS.get(operation, ([], {}))
    expected = dict(expected)
    for name, dest in declared.command.options.items():
        if name in CLI_LEFT_OUT.get(operation, ()):
            continue
        value = sample(operation, name)
        action = actions[dest]
        if not action.option_strings:
            positional.append(str(value))
        elif action.nargs == 0:
            optional.append(action.option_strings[0])
        else:
            optional += [action.option_strings[0], str(value)]
        expected[name] = value
    return ["ledger", *declared.command.words, *positional, *optional, *extra_argv], expected


@pytest.mark.parametrize(
    "operation", sorted(name for name, operation in OPERATIONS.items() if operation.command and name not in CLI_NOT_RUN)
)
def test_the_command_hands_the_store_each_option_as_given(operation, monkeypatch):
    store = RecordingLedger()
    monkeypatch.setattr(cli_ledger, "ledger_from_flags", lambda args: store)
    argv, expected = command_line(operation)
    with pytest.raises(Recorded):
        main(["--debug", *argv])  # --debug lets the stand-in's exception through the one-paragraph handler
    ((name, arguments),) = store.calls
    assert name == operation, argv
    arguments.pop("caller")
    for parameter in OPERATIONS[operation].parameters:
        value = expected.get(parameter.name, parameter.default)
        assert comparable(parameter.name, arguments[parameter.name]) == comparable(parameter.name, value), \
            (argv, parameter.name)
