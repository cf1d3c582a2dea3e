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
 .msg.json span{display:inline-block;vertical-align:top;font-family:ui-monospace,monospace;font-size:12px}
 .tool{margin:4px 0 0 76px;padding:3px 8px;border:1px solid #d8c48f;border-radius:6px;background:#fbf5e3;
  font-family:ui-monospace,monospace;font-size:12px;white-space:pre-wrap;word-break:break-all}
 details{margin-top:6px;font-size:13px} #tools{width:100%;box-sizing:border-box;height:90px;font-family:ui-monospace,monospace;font-size:12px}
</style></head>
<body>
<header><h1>Serval</h1><span id="model">loading…</span><span id="health"></span>
 <span style="margin-left:auto">API key <input id="key" type="password" size="12"></span></header>
<main>
<section><h2>Chat</h2>
 <div id="log"></div>
 <textarea id="prompt" placeholder="Ask something…"></textarea>
 <div><button id="send">Send</button> <label>max tokens <input id="max" type="number" value="128" style="width:60px"></label>
 <label>temperature <input id="temp" type="number" value="0.7" step="0.1" style="width:50px"></label>
 <label title="response_format: json_object"><input id="json" type="checkbox"> JSON mode</label> <span id="speed"></span></div>
 <details id="tools-box"><summary>tools (optional)</summary>
  <textarea id="tools" placeholder='[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]'></textarea>
 </details>
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
// Tool calls as they stream: OpenAI's delta.tool_calls fragments, concatenated per index.
function mergeToolCalls(calls, fragments) {
  for (const f of fragments) {
    const i = f.index ?? calls.length;
    const c = calls[i] || (calls[i] = {id: '', type: 'function', function: {name: '', arguments: ''}});
    if (f.id) c.id = f.id;
    if (f.type) c.type = f.type;
    if (f.function && f.function.name) c.function.name += f.function.name;
    if (f.function && f.function.arguments) c.function.arguments += f.function.arguments;
  }
}
function showToolCalls(msg, calls) {
  msg.querySelectorAll('.tool').forEach(e => e.remove());
  for (const c of calls.filter(Boolean)) {
    const d = document.createElement('div'); d.className = 'tool';
    d.textContent = '\u{1F527} ' + c.function.name + '(' + c.function.arguments + ')';
    msg.appendChild(d);
  }
}
async function send() {
  const text = $('prompt').value.trim(); if (!text) return;
  let tools = null;
  if ($('tools').value.trim()) {
    try { tools = JSON.parse($('tools').value); } catch (e) { addMsg('error', 'tools: ' + e.message); return; }
  }
  $('prompt').value = ''; addMsg('user', text); history.push({role: 'user', content: text});
  const prev = $('last-reply'); if (prev) prev.removeAttribute('id');
  const out = addMsg('assistant', ''); const msg = out.parentNode; msg.id = 'last-reply';
  const jsonMode = $('json').checked;
  const body = {messages: history, stream: true, max_tokens: +$('max').value, temperature: +$('temp').value};
  if (jsonMode) body.response_format = {type: 'json_object'};
  if (tools) body.tools = tools;
  const t0 = performance.now(); let n = 0, first = 0; const calls = [];
  const res = await fetch('/v1/chat/completions', {method: 'POST', headers: headers(), body: JSON.stringify(body)});
  if (!res.ok) { out.textContent = 'error: ' + (await res.text()); msg.dataset.done = 'error'; return; }
  const onChoice = c => {
    if (!c) return;
    if (c.delta && c.delta.content) { if (!n++) first = performance.now() - t0; out.textContent += c.delta.content; $('log').scrollTop = 1e9; }
    if (c.delta && c.delta.tool_calls) { if (!n++) first = performance.now() - t0; mergeToolCalls(calls, c.delta.tool_calls); showToolCalls(msg, calls); }
    if (c.message) {  // a whole message (a server that did not stream)
      if (c.message.content) out.textContent += c.message.content;
      if (c.message.tool_calls) { calls.length = 0; calls.push(...c.message.tool_calls); showToolCalls(msg, calls); }
    }
    if (c.finish_reason) msg.dataset.finish = c.finish_reason;
  };
  if (!(res.headers.get('content-type') || '').includes('text/event-stream')) {
    const j = await res.json(); onChoice(j.choices && j.choices[0]);
  } else {
    const reader = res.body.getReader(); const dec = new TextDecoder(); let buf = '';
    for (;;) {
      const {value, done} = await reader.read(); if (done) break;
      buf += dec.decode(value, {stream: true});
      let i; while ((i = buf.indexOf('\n\n')) >= 0) {
        const line = buf.slice(0, i); buf = buf.slice(i + 2);
        if (!line.startsWith('data: ')) continue; const data = line.slice(6);
        if (data === '[DONE]') continue;
        const j = JSON.parse(data); onChoice(j.choices && j.choices[0]);
      }
    }
  }
  const reply = {role: 'assistant', content: out.textContent};
  if (calls.length) reply.tool_calls = calls.filter(Boolean);
  history.push(reply);
  if (jsonMode) {  // shown pretty-printed once complete, if it parses
    try { out.textContent = JSON.stringify(JSON.parse(out.textContent), null, 2); msg.classList.add('json'); msg.dataset.json = 'ok'; }
    catch (e) { msg.dataset.json = 'invalid'; }
  }
  msg.dataset.done = '1';
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
