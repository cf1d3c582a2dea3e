#include "server/web_page.h"

namespace serval {

const std::string& web_page_html() {
  static const std::string page = R"HTML(<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Serval</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
 body{font-family:system-ui,sans-serif;margin:0;background:#f6f5f2;color:#222}
 header{background:#2d2a26;color:#f3e9d2;padding:10px 18px;display:flex;gap:16px;align-items:baseline}
 header h1{font-size:20px;margin:0} header span{opacity:.8;font-size:13px}
 main{display:grid;grid-template-columns:1fr 1fr;gap:14px;padding:14px}
 section{background:#fff;border-radius:8px;padding:12px;box-shadow:0 1px 3px #0002}
 h2{font-size:15px;margin:0 0 8px}
 #log{height:360px;overflow:auto;border:1px solid #ddd;border-radius:6px;padding:8px;background:#fcfcfb}
 .msg{margin:6px 0;white-space:pre-wrap} .user{color:#1f4e8c} .assistant{color:#2d2a26}
 .msg b{display:inline-block;min-width:76px}
 #prompt{width:100%;box-sizing:border-box;height:60px;margin-top:8px}
 button{padding:6px 14px;margin-top:6px}
 .stats{display:grid;grid-template-columns:repeat(4,1fr);gap:8px;margin-bottom:10px}
 .stat{background:#f1efe9;border-radius:6px;padding:6px;text-align:center}
 .stat div{font-size:20px;font-weight:600}
 #blocks{display:flex;flex-wrap:wrap;gap:1px;max-height:150px;overflow:auto}
 #blocks i{width:8px;height:8px;display:block}
 .f{background:#e4e2dc}.u{background:#3a7d44}.c{background:#e3b23c}.s{background:#c0392b}
 .legend i{display:inline-block;width:10px;height:10px;margin:0 4px 0 10px}
 svg{width:100%;height:90px;background:#fbfaf7;border:1px solid #eee}
 table{font-size:12px;border-collapse:collapse;width:100%} td,th{border-bottom:1px solid #eee;padding:2px 4px;text-align:left}
</style></head>
<body>
<header><h1>Serval</h1><span id="model">loading…</span><span id="health"></span>
 <span style="margin-left:auto">API key <input id="key" type="password" size="12"></span></header>
<main>
<section><h2>Chat</h2>
 <div id="log"></div>
 <textarea id="prompt" placeholder="Ask something…"></textarea>
 <div><button id="send">Send</button> <label>max tokens <input id="max" type="number" value="128" style="width:60px"></label>
 <label>temperature <input id="temp" type="number" value="0.7" step="0.1" style="width:50px"></label> <span id="speed"></span></div>
</section>
<section><h2>Engine</h2>
 <div class="stats">
  <div class="stat">running<div id="running">0</div></div>
  <div class="stat">waiting<div id="waiting">0</div></div>
  <div class="stat">KV usage<div id="kv">0%</div></div>
  <div class="stat">prefix hit rate<div id="hit">–</div></div>
  <div class="stat">speculative: accepted tokens per step<div id="spec">off</div></div>
 </div>
 <div class="legend">KV blocks:<i class="f"></i>free<i class="u"></i>used<i class="c"></i>cached<i class="s"></i>shared</div>
 <div id="blocks"></div>
 <h2 style="margin-top:10px">TTFT (ms) <small id="ttftlast"></small></h2><svg id="ttft"></svg>
 <h2>TPOT (ms) <small id="tpotlast"></small></h2><svg id="tpot"></svg>
 <table><thead><tr><th>request</th><th>state</th><th>prompt</th><th>generated</th></tr></thead><tbody id="reqs"></tbody></table>
</section>
</main>
<script>
const $ = id => document.getElementById(id);
$('key').value = localStorage.getItem('serval-key') || '';
$('key').onchange = () => localStorage.setItem('serval-key', $('key').value);
function headers() {
  const h = {'Content-Type': 'application/json'};
  if ($('key').value) h['Authorization'] = 'Bearer ' + $('key').value;
  return h;
}
let history = [];
function addMsg(role, text) {
  const d = document.createElement('div'); d.className = 'msg ' + role;
  d.innerHTML = '<b>' + role + '</b>'; const s = document.createElement('span'); s.textContent = text; d.appendChild(s);
  $('log').appendChild(d); $('log').scrollTop = 1e9; return s;
}
async function send() {
  const text = $('prompt').value.trim(); if (!text) return;
  $('prompt').value = ''; addMsg('user', text); history.push({role: 'user', content: text});
  const out = addMsg('assistant', ''); out.parentNode.id = 'last-reply';
  const t0 = performance.now(); let n = 0, first = 0;
  const res = await fetch('/v1/chat/completions', {method: 'POST', headers: headers(), body: JSON.stringify({
    messages: history, stream: true, max_tokens: +$('max').value, temperature: +$('temp').value})});
  if (!res.ok) { out.textContent = 'error: ' + (await res.text()); return; }
  const reader = res.body.getReader(); const dec = new TextDecoder(); let buf = '';
  for (;;) {
    const {value, done} = await reader.read(); if (done) break;
    buf += dec.decode(value, {stream: true});
    let i; while ((i = buf.indexOf('\n\n')) >= 0) {
      const line = buf.slice(0, i); buf = buf.slice(i + 2);
      if (!line.startsWith('data: ')) continue; const data = line.slice(6);
      if (data === '[DONE]') continue;
      const j = JSON.parse(data); const c = j.choices && j.choices[0];
      if (c && c.delta && c.delta.content) { if (!n++) first = performance.now() - t0; out.textContent += c.delta.content; $('log').scrollTop = 1e9; }
      if (c && c.finish_reason) out.parentNode.dataset.finish = c.finish_reason;
    }
  }
  history.push({role: 'assistant', content: out.textContent});
  const secs = (performance.now() - t0) / 1000;
  $('speed').textContent = `TTFT ${first.toFixed(0)} ms · ${n} tokens · ${(n / secs).toFixed(1)} tok/s`;
}
$('send').onclick = send;
$('prompt').onkeydown = e => { if (e.key === 'Enter' && !e.shiftKey) { e.preventDefault(); send(); } };
function plot(svg, points) {
  const el = $(svg); if (!points.length) { el.innerHTML = ''; return; }
  const t0 = points[0][0], t1 = Math.max(points[points.length - 1][0], t0 + 1);
  const vmax = Math.max(...points.map(p => p[1])) * 1.1 || 1;
  const w = el.clientWidth || 400, h = 90;
  const pts = points.map(p => `${((p[0] - t0) / (t1 - t0) * (w - 10) + 5).toFixed(1)},${(h - 5 - p[1] / vmax * (h - 10)).toFixed(1)}`);
  el.innerHTML = `<polyline fill="none" stroke="#3a7d44" stroke-width="2" points="${pts.join(' ')}"/>` +
    `<text x="5" y="12" font-size="10">${(vmax * 1000).toFixed(0)}</text>`;
}
let polls = 0;
async function poll() {
  try {
    const h = await fetch('/health'); $('health').textContent = (await h.json()).status;
    const r = await fetch('/engine/state', {headers: headers()});
    if (r.ok) {
      const s = await r.json(); polls++;
      document.body.dataset.polls = polls;
      $('model').textContent = s.model;
      $('running').textContent = s.running.length; $('waiting').textContent = s.waiting.length;
      $('kv').textContent = (100 * s.kv_usage).toFixed(1) + '%';
      $('hit').textContent = s.prefix_queries ? (100 * s.prefix_hits / s.prefix_queries).toFixed(1) + '%' : '–';
      const sp = s.spec;  // tokens kept per verification step: accepted guesses plus the target's own token
      $('spec').textContent = sp.method === 'none' ? 'off' : sp.drafts ?
        `${(1 + sp.accepted_tokens / sp.drafts).toFixed(2)} (${sp.method}, ${(100 * sp.accepted_tokens / sp.draft_tokens).toFixed(0)}% of guesses)` :
        `${sp.method}, no guesses yet`;
      $('blocks').innerHTML = [...s.blocks].map(b => `<i class="${b}"></i>`).join('');
      plot('ttft', s.latency.ttft); plot('tpot', s.latency.tpot);
      const last = a => a.length ? (a[a.length - 1][1] * 1000).toFixed(1) + ' ms' : '';
      $('ttftlast').textContent = last(s.latency.ttft); $('tpotlast').textContent = last(s.latency.tpot);
      $('reqs').innerHTML = s.running.map(q => `<tr><td>${q.id}</td><td>running</td><td>${q.prompt}</td><td>${q.generated}</td></tr>`)
        .concat(s.waiting.map(q => `<tr><td>${q.id}</td><td>${q.preempted ? 'preempted' : 'waiting'}</td><td>${q.prompt}</td><td>${q.generated}</td></tr>`)).join('');
    }
  } catch (e) {}
  setTimeout(poll, 500);
}
poll();
</script></body></html>
)HTML";
  return page;
}

}  // namespace serval
