"""``/dashboard``: a live status page with no build toolchain - one static HTML page whose script
polls ``/dashboard/data`` (figures computed here from the app's own Prometheus registry)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from router.pipeline.service import RouterService
    from router.telemetry import Telemetry

__all__ = ["DASHBOARD_HTML", "dashboard_data"]


def _samples(telemetry: Telemetry) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in telemetry.registry.collect():
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def _quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Prometheus-style histogram_quantile over cumulative (le, count) pairs."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if le == float("inf"):
                return prev_le
            span = count - prev_count
            frac = (rank - prev_count) / span if span else 1.0
            return prev_le + (le - prev_le) * frac
        prev_le, prev_count = le, count
    return prev_le


def _hist(
    samples: dict[str, list[tuple[dict[str, str], float]]], name: str, tier: str
) -> dict[str, float | None]:
    buckets = sorted(
        (float(labels["le"]), value)
        for labels, value in samples.get(f"{name}_bucket", [])
        if labels.get("tier") == tier
    )
    return {f"p{int(q * 100)}": _quantile(buckets, q) for q in (0.5, 0.95, 0.99)}


def _by_tier(samples: dict[str, list[tuple[dict[str, str], float]]], name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for labels, value in samples.get(name, []):
        tier = labels.get("tier", "")
        out[tier] = out.get(tier, 0.0) + value
    return out


def dashboard_data(telemetry: Telemetry, service: RouterService) -> dict[str, Any]:
    s = _samples(telemetry)
    running = _by_tier(s, "router_running_requests")
    waiting = _by_tier(s, "router_waiting_requests")
    drafted = _by_tier(s, "router_spec_decode_draft_tokens_total")
    accepted = _by_tier(s, "router_spec_decode_accepted_tokens_total")
    completion = _by_tier(s, "router_completion_tokens_total")
    requests: dict[str, dict[str, float]] = {}
    for labels, value in s.get("router_requests_total", []):
        per = requests.setdefault(labels["tier"], {})
        per[labels["outcome"]] = per.get(labels["outcome"], 0.0) + value
    mix: dict[str, float] = {}
    rules: dict[str, float] = {}
    for labels, value in s.get("router_route_decisions_total", []):
        mix[labels["tier"]] = mix.get(labels["tier"], 0.0) + value
        rules[labels["rule"]] = rules.get(labels["rule"], 0.0) + value
    tiers = []
    for name, cfg in service.policy.tiers.items():
        d = drafted.get(name, 0.0)
        tiers.append(
            {
                "name": name,
                # Remote tiers show as "remote": their URLs (and any credentials in them) and local
                # model paths stay off the page.
                "model": "remote" if cfg.is_remote else Path(cfg.model).name,
                "quantization": cfg.quantization,
                "draft": cfg.draft,
                "running": running.get(name, 0.0),
                "waiting": waiting.get(name, 0.0),
                "capacity": cfg.max_num_seqs,
                "requests": requests.get(name, {}),
                "completion_tokens": completion.get(name, 0.0),
                "ttft_s": _hist(s, "router_time_to_first_token_seconds", name),
                "e2e_s": _hist(s, "router_request_duration_seconds", name),
                "itl_s": _hist(s, "router_inter_token_latency_seconds", name),
                "acceptance_rate": (accepted.get(name, 0.0) / d) if d else None,
            }
        )
    hits = sum(v for _, v in s.get("router_cache_hits_total", []))
    misses = sum(v for _, v in s.get("router_cache_misses_total", []))
    return {
        "time": time.time(),
        "ready": service.ready,
        "draining": service.draining,
        "policy": {"source": Path(service.policy.source).name, "version": service.policy.digest[:12]},
        "tiers": tiers,
        "routing_mix": mix,
        "rules": rules,
        "cache": {"hits": hits, "misses": misses},
        "reloads": sum(v for _, v in s.get("router_policy_reloads_total", [])),
        "reload_failures": sum(v for _, v in s.get("router_policy_reload_failures_total", [])),
    }


DASHBOARD_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>tiered-router</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
 body{font:14px/1.4 system-ui,sans-serif;margin:24px;background:#0f1419;color:#e6e6e6}
 h1{font-size:20px;margin:0 0 4px} .sub{color:#8b949e;margin-bottom:18px}
 .grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(300px,1fr));gap:14px}
 .card{background:#161b22;border:1px solid #30363d;border-radius:8px;padding:14px}
 .card h2{font-size:16px;margin:0 0 8px} table{width:100%;border-collapse:collapse}
 td{padding:3px 0} td.v{text-align:right;font-variant-numeric:tabular-nums}
 .bar{height:10px;background:#30363d;border-radius:5px;overflow:hidden;margin:4px 0 10px}
 .bar>div{height:100%;background:#2f81f7} .ok{color:#3fb950} .bad{color:#f85149}
 .mix span{display:inline-block;height:18px} .legend{color:#8b949e;font-size:12px}
</style></head><body>
<h1>tiered-router</h1><div class="sub" id="status">loading...</div>
<div class="card" style="margin-bottom:14px"><h2>Routing mix</h2><div class="mix" id="mix"></div>
<div class="legend" id="mixlegend"></div></div>
<div class="grid" id="tiers"></div>
<div class="grid" style="margin-top:14px"><div class="card"><h2>Rules fired</h2><table id="rules"></table></div>
<div class="card"><h2>Cache and policy</h2><table id="misc"></table></div></div>
<script>
const colors=["#2f81f7","#a371f7","#f0883e","#3fb950","#db61a2"];
const ms=v=>v==null?"-":(v*1000).toFixed(v<0.1?1:0)+" ms";
const row=(k,v)=>`<tr><td>${k}</td><td class="v">${v}</td></tr>`;
async function tick(){
 try{
  const d=await (await fetch("dashboard/data")).json();
  document.getElementById("status").innerHTML=
   `<span class="${d.ready?"ok":"bad"}">${d.ready?"ready":(d.draining?"draining":"not ready")}</span>`+
   ` &middot; policy ${d.policy.version} (${d.policy.source}) &middot; ${new Date(d.time*1000).toLocaleTimeString()}`;
  const total=Object.values(d.routing_mix).reduce((a,b)=>a+b,0)||1;
  document.getElementById("mix").innerHTML=d.tiers.map((t,i)=>
   `<span style="width:${100*(d.routing_mix[t.name]||0)/total}%;background:${colors[i%5]}"></span>`).join("");
  document.getElementById("mixlegend").innerHTML=d.tiers.map((t,i)=>
   `<span style="color:${colors[i%5]}">&#9632;</span> ${t.name} ${(100*(d.routing_mix[t.name]||0)/total).toFixed(0)}%`).join(" &nbsp; ");
  document.getElementById("tiers").innerHTML=d.tiers.map(t=>{
   const load=t.capacity?Math.min(100,100*t.running/t.capacity):0;
   const req=Object.entries(t.requests).map(([k,v])=>`${k}: ${v}`).join(", ")||"none";
   return `<div class="card"><h2>${t.name}</h2><div class="legend">${t.model} &middot; ${t.quantization}`+
    `${t.draft?" &middot; drafts with "+t.draft:""}</div>`+
    `<div class="bar"><div style="width:${load}%"></div></div><table>`+
    row("running / capacity",`${t.running} / ${t.capacity}`)+row("waiting",t.waiting)+row("requests",req)+
    row("TTFT p50 / p95",`${ms(t.ttft_s.p50)} / ${ms(t.ttft_s.p95)}`)+
    row("latency p50 / p95 / p99",`${ms(t.e2e_s.p50)} / ${ms(t.e2e_s.p95)} / ${ms(t.e2e_s.p99)}`)+
    row("inter-token p50",ms(t.itl_s.p50))+row("tokens generated",t.completion_tokens)+
    row("draft acceptance",t.acceptance_rate==null?"-":(100*t.acceptance_rate).toFixed(1)+"%")+"</table></div>";
  }).join("");
  document.getElementById("rules").innerHTML=Object.entries(d.rules).map(([k,v])=>row(k,v)).join("")||row("none yet","");
  const c=d.cache,n=c.hits+c.misses;
  document.getElementById("misc").innerHTML=row("cache hits / misses",`${c.hits} / ${c.misses}`)+
   row("hit rate",n?(100*c.hits/n).toFixed(1)+"%":"-")+row("policy reloads",d.reloads)+row("reload failures",d.reload_failures);
 }catch(e){document.getElementById("status").textContent="cannot reach the router: "+e;}
}
tick();setInterval(tick,2000);
</script></body></html>
"""
