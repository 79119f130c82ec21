"""Operator commands: API keys (``aiserve keys``) and the usage report (``aiserve usage``).

Both work on the files under ``$AISERVE_HOME`` directly (the keys database and the usage
ledger), so they work whether or not the suite runs; the gateway sees a new or revoked key on
its next request. The usage report only reads the ledger (``LedgerReader``: read-only, it never
creates or changes the file).
"""

from __future__ import annotations

import argparse
import csv
import sys
from datetime import UTC, datetime
from pathlib import Path

from aiserve.common.paths import KEYS_FILE, LEDGER_FILE, aiserve_home
from services.gateway.ledger import COLUMNS, LedgerMissingError, LedgerReader
from services.gateway.tenants import TIERS, KeyStore, Tenant, TenantError


def _home(args: argparse.Namespace) -> Path:
    return Path(args.home) if args.home else aiserve_home()


def _when(unix_ms: int | None) -> str:
    return "-" if unix_ms is None else datetime.fromtimestamp(unix_ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _ms(field: str, text: str | None) -> int | None:
    if not text:
        return None
    moment = datetime.fromisoformat(text)
    if moment.tzinfo is None:
        raise SystemExit(f"aiserve: --{field}: give an RFC 3339 time with an offset, e.g. 2025-01-31T00:00:00Z")
    return int(moment.timestamp() * 1000)


def cmd_keys(args: argparse.Namespace) -> int:
    """``aiserve keys create|list|revoke``."""
    store = KeyStore(_home(args) / KEYS_FILE)
    try:
        if args.action == "create":
            if not args.tenant:
                print("usage: aiserve keys create --tenant NAME [--tier free|paid] [--rpm N] [--tpm N] "
                      "[--budget-micros N]", file=sys.stderr)
                return 2
            old = store.tenant(args.tenant) or Tenant(args.tenant, "free")
            store.put_tenant(Tenant(
                args.tenant, args.tier or old.tier,
                args.rpm if args.rpm is not None else old.requests_per_minute,
                args.tpm if args.tpm is not None else old.tokens_per_minute,
                args.budget_micros if args.budget_micros is not None else old.budget_micros,
            ))
            key_id, key = store.create_key(args.tenant)
            print(key)
            print(f"key ais_{key_id} for tenant {args.tenant}: shown once, stored only as a hash", file=sys.stderr)
        elif args.action == "list":
            print("key_id\ttenant\ttier\tcreated\trevoked")
            for info in store.list_keys(args.tenant):
                print(f"ais_{info.key_id}\t{info.tenant}\t{info.tier}\t{_when(info.created_at_ms)}\t"
                      f"{_when(info.revoked_at_ms)}")
        elif args.action == "revoke":
            if not args.key_id:
                print("usage: aiserve keys revoke KEY_ID", file=sys.stderr)
                return 2
            store.revoke(args.key_id)
            print(f"revoked {args.key_id}")
    except TenantError as exc:
        print(f"aiserve: {exc}", file=sys.stderr)
        return 2
    finally:
        store.close()
    return 0


def cmd_usage(args: argparse.Namespace) -> int:
    """``aiserve usage``: cost by tenant, day and model; every row of the period as CSV."""
    since, until = _ms("since", args.since), _ms("until", args.until)
    try:
        ledger = LedgerReader(_home(args) / LEDGER_FILE)
    except LedgerMissingError as exc:
        print(f"aiserve: {exc}", file=sys.stderr)
        return 2
    buckets = ledger.buckets(args.tenant, since, until)
    rows = ledger.rows(args.tenant, since, until) if args.csv else []
    print(f"{'tenant':<20} {'day':<10} {'model':<32} {'requests':>8} {'prompt':>9} {'completion':>10} {'cost':>12}")
    for b in buckets:
        t = b.totals
        print(f"{b.tenant or '(unauthenticated)':<20} {b.day:<10} {b.model:<32} {t.requests:>8} "
              f"{t.prompt_tokens:>9} {t.completion_tokens:>10} {t.cost_micros / 1e6:>12.6f}")
    total = sum(b.totals.cost_micros for b in buckets)
    print(f"total: {sum(b.totals.requests for b in buckets)} requests, cost {total / 1e6:.6f} ({total} micros)")
    if args.csv:
        with open(args.csv, "w", newline="") as file:
            writer = csv.writer(file)
            writer.writerow(COLUMNS)
            for row in rows:
                writer.writerow([getattr(row, name) for name in COLUMNS])
        print(f"wrote {len(rows)} rows to {args.csv}")
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register ``keys`` and ``usage`` on the ``aiserve`` parser."""
    keys = sub.add_parser("keys", help="API keys and tenants")
    keys.add_argument("action", choices=["create", "list", "revoke"])
    keys.add_argument("key_id", nargs="?", help="revoke: the key id (ais_xxxxxxxx) that `keys list` shows")
    keys.add_argument("--tenant", help="create: the tenant (made if new); list: only its keys")
    keys.add_argument("--tier", choices=TIERS, help="create: the tenant's tier (default: free, or unchanged)")
    keys.add_argument("--rpm", type=int, help="create: the tenant's own requests per minute (default: the tier's)")
    keys.add_argument("--tpm", type=int, help="create: the tenant's own tokens per minute")
    keys.add_argument("--budget-micros", type=int, help="create: the tenant's own budget per period (0 = none)")
    keys.add_argument("--home", help="state folder (default $AISERVE_HOME or var)")
    keys.set_defaults(func=cmd_keys)

    usage = sub.add_parser("usage", help="usage and cost report from the ledger, CSV export")
    usage.add_argument("--tenant", help="only this tenant")
    usage.add_argument("--since", help="RFC 3339 start, inclusive")
    usage.add_argument("--until", help="RFC 3339 end, exclusive")
    usage.add_argument("--csv", help="also write every ledger row of the period to this CSV file")
    usage.add_argument("--home", help="state folder (default $AISERVE_HOME or var)")
    usage.set_defaults(func=cmd_usage)
