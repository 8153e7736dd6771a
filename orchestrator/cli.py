"""The ``orchestrator`` command: serve, migrate, admin and key tools."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from orchestrator.settings import Settings, get_settings

app = typer.Typer(help="Coordinator for permissionless compute pools.", no_args_is_help=True)
admin_app = typer.Typer(help="Operator tokens and other admin tasks.", no_args_is_help=True)
keys_app = typer.Typer(help="Ed25519 key files for providers and nodes.", no_args_is_help=True)
app.add_typer(admin_app, name="admin")
app.add_typer(keys_app, name="keys")
console = Console(stderr=True)


def check_process_model(settings: Settings, workers: int) -> None:
    """The in-process hot store cannot be shared: refuse to run it in several processes."""
    if workers > 1 and settings.redis_url is None:
        raise typer.BadParameter(
            f"--workers {workers} needs a shared hot store: the in-process store (used when "
            "ORCH_REDIS__URL is unset) would give each process its own nonces, liveness and rate "
            "limits. Set ORCH_REDIS__URL=redis://... or run a single worker.",
            param_hint="--workers",
        )


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="Bind address [ORCH_SERVER__HOST]")] = None,
    port: Annotated[int | None, typer.Option(help="Port [ORCH_SERVER__PORT]")] = None,
    workers: Annotated[int | None, typer.Option(help="Worker processes [ORCH_SERVER__WORKERS]")] = None,
    migrate: Annotated[
        bool | None, typer.Option(help="Upgrade the schema first [ORCH_SERVER__MIGRATE_ON_START]")
    ] = None,
) -> None:
    """Run the API server (uvicorn)."""
    import uvicorn

    settings = get_settings()
    n = workers or settings.server.workers
    check_process_model(settings, n)
    if migrate if migrate is not None else settings.server.migrate_on_start:
        from orchestrator.core.migrate import upgrade

        upgrade(settings.db.url)
    uvicorn.run(
        "orchestrator.app:create_app",
        factory=True,
        host=host or settings.server.host,
        port=port or settings.server.port,
        workers=n,
        proxy_headers=settings.server.trust_proxy_headers,
        forwarded_allow_ips="*" if settings.server.trust_proxy_headers else None,
        access_log=False,
        log_level=settings.log_level.lower(),
    )


@app.command("migrate")
def migrate_cmd(
    revision: Annotated[str, typer.Option(help="Target revision")] = "head",
    downgrade: Annotated[bool, typer.Option(help="Downgrade to --revision instead")] = False,
) -> None:
    """Upgrade (or downgrade) the database schema."""
    from orchestrator.core import migrate

    url = get_settings().db.url
    if downgrade:
        migrate.downgrade(url, "base" if revision == "head" else revision)
    else:
        migrate.upgrade(url, revision)
    console.print(f"[green]schema at {revision if not downgrade else 'requested revision'}[/green]")


async def _create_token(role: str, name: str, pools: list[str]) -> tuple[str, str]:
    from orchestrator.admin.tokens import Role, create_token
    from orchestrator.core.db import make_engine, make_sessionmaker

    engine = make_engine(get_settings().db)
    try:
        async with make_sessionmaker(engine)() as session, session.begin():
            token, row = await create_token(session, role=Role(role), name=name, pool_ids=pools)
            return token, row.id
    finally:
        await engine.dispose()


@admin_app.command("create-token")
def create_token_cmd(
    role: Annotated[str, typer.Option(help="admin | operator | validator | trainer")],
    name: Annotated[str, typer.Option(help="Who or what the token is for")] = "cli",
    pool: Annotated[
        list[str] | None, typer.Option(help="A pool a validator or trainer token may act on (repeatable)")
    ] = None,
) -> None:
    """Create an API token and print it once (only its hash is stored)."""
    if role not in {"admin", "operator", "validator", "trainer"}:
        raise typer.BadParameter("role must be admin, operator, validator or trainer", param_hint="--role")
    if role in {"validator", "trainer"} and not pool:
        raise typer.BadParameter("validator and trainer tokens need at least one --pool", param_hint="--pool")
    token, token_id = asyncio.run(_create_token(role, name, list(pool or [])))
    console.print(f"created {role} token {token_id}; it is shown only now:")
    typer.echo(token)


@keys_app.command("generate")
def keys_generate(
    path: Annotated[Path, typer.Argument(help="Key file to write (mode 0600)")],
    force: Annotated[bool, typer.Option(help="Overwrite an existing file")] = False,
) -> None:
    """Generate an Ed25519 key file and print its public id."""
    from orchestrator.core.keys import generate_key, key_id_of, write_key_file

    key = generate_key()
    try:
        write_key_file(path, key, force=force)
    except FileExistsError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from exc
    typer.echo(key_id_of(key))


if __name__ == "__main__":
    app()
