# fleet task runner. `just --list` shows the recipes.

# Start the embedded stack (private Redis, SQLite, gateway, one worker) on 127.0.0.1:8000.
up profile="offline":
    uv run fleet up --profile {{profile}}

# Everything CI runs, on this machine.
ci:
    bash .ci/run

# The test suite (needs Redis and PostgreSQL on 127.0.0.1, bwrap and Node).
test *args:
    uv run pytest {{args}}

# schemathesis against a live stack (tests/fuzz): 200 examples per operation, a fresh seed each run
# (`uv run pytest` runs the same suite with 10, derandomized). `just fuzz 1000` runs longer.
fuzz examples="200":
    FLEET_FUZZ_EXAMPLES={{examples}} uv run pytest tests/fuzz -m fuzz -s

# Lint, format check and type check.
check:
    uv run ruff check .
    uv run ruff format --check .
    uv run mypy

# Format the code.
fmt:
    uv run ruff check --fix .
    uv run ruff format .

# Write openapi.yaml from the app (tests/integration/test_openapi.py fails when they drift).
openapi:
    uv run python -m fleet_gateway.openapi openapi.yaml

# Migrate the database named by FLEET_DATABASE_URL to head.
migrate:
    uv run fleet db upgrade

# Benchmark lanes (bench/README.md): `just bench` runs them all, `just bench turn fanout` some,
# `--quick` a smoke run; receipts go to bench/receipts/. `just bench report` summarises the latest.
bench *lanes:
    uv run python -m bench {{lanes}}
