// A contributor client in JavaScript, written from docs/PROTOCOL.md alone: Node's own crypto
// (Ed25519, SHA-256) and fetch, RFC 9421 signatures built by hand, JSON.parse for every answer
// (numbers as doubles). It registers a provider and a node, joins the pool, beats, claims the
// tasks, answers each with "4" and its seed echoed, sends one answer again, then waits for its
// verdicts. Prints one JSON line for the test to check.
//
//   node worker.mjs http://127.0.0.1:PORT POOL_ID TASKS
import crypto from "node:crypto";

const [base, poolId, taskCount] = process.argv.slice(2);
const authority = new URL(base).host;
const b64url = (buf) => Buffer.from(buf).toString("base64url");

function keyPair() {
  const { privateKey, publicKey } = crypto.generateKeyPairSync("ed25519");
  return { privateKey, id: publicKey.export({ format: "jwk" }).x }; // raw key, unpadded base64url
}

async function signed(key, method, path, body) {
  const raw = body === undefined ? undefined : JSON.stringify(body);
  const components = ['"@method"', '"@authority"', '"@path"'];
  const lines = [`"@method": ${method}`, `"@authority": ${authority}`, `"@path": ${path}`];
  const headers = {};
  if (raw !== undefined) {
    const digest = `sha-256=:${crypto.createHash("sha256").update(raw).digest("base64")}:`;
    headers["Content-Type"] = "application/json";
    headers["Content-Digest"] = digest;
    components.push('"content-digest"');
    lines.push(`"content-digest": ${digest}`);
  }
  const created = Math.floor(Date.now() / 1000);
  const nonce = b64url(crypto.randomBytes(16));
  const params = `(${components.join(" ")});created=${created};keyid="${key.id}";nonce="${nonce}";alg="ed25519"`;
  lines.push(`"@signature-params": ${params}`);
  const signature = crypto.sign(null, Buffer.from(lines.join("\n")), key.privateKey);
  headers["Signature-Input"] = `sig1=${params}`;
  headers["Signature"] = `sig1=:${signature.toString("base64")}:`;
  const response = await fetch(base + path, { method, headers, body: raw });
  return { status: response.status, body: JSON.parse(await response.text()) };
}

function expect(what, answer, ...statuses) {
  if (!statuses.includes(answer.status)) {
    throw new Error(`${what}: ${answer.status} ${JSON.stringify(answer.body)}`);
  }
  return answer.body;
}

const provider = keyPair();
const node = keyPair();
expect("provider", await signed(provider, "POST", "/v1/providers", { display_name: "js" }), 201);
const attestation = b64url(crypto.sign(null, Buffer.from(`orchestrator/v1/attest-node:${node.id}`), provider.privateKey));
const specs = { gpu_model: "NVIDIA H100 80GB HBM3", gpu_count: 1, gpu_memory_mb: 81559, cpu_cores: 16, ram_mb: 131072 };
expect("node", await signed(node, "POST", "/v1/nodes", { provider_id: provider.id, attestation, specs, version: "js-0.1" }), 201);
expect("join", await signed(node, "POST", `/v1/pools/${poolId}/join`, {}), 201);
expect("heartbeat", await signed(node, "POST", "/v1/nodes/me/heartbeat", { metrics: { gpu_util: 0.5 } }), 200);

const claim = expect("claim", await signed(node, "POST", "/v1/assignments/claim", { pool_id: poolId, max_tasks: Number(taskCount) }), 200);
const results = [];
let again = null;
for (const lease of claim.leases) {
  const body = {
    fencing_token: lease.fencing_token,
    policy_step: lease.policy.step,
    seed: lease.seed, // a double: exact only below 2^53
    samples: [{ completion: "4", finish_reason: "stop", prompt_tokens: 3, completion_tokens: 1 }],
  };
  const path = `/v1/assignments/${lease.assignment_id}/result`;
  results.push(expect("result", await signed(node, "POST", path, body), 201));
  if (again === null) {
    again = expect("result again", await signed(node, "POST", path, body), 200);
  }
}

let verdicts = [];
for (let i = 0; i < 120 && verdicts.length < results.length; i++) {
  await new Promise((resolve) => setTimeout(resolve, 250));
  verdicts = expect("verdicts", await signed(node, "GET", "/v1/nodes/me/verdicts"), 200).items;
}
console.log(JSON.stringify({
  node_id: node.id,
  seeds: claim.leases.map((lease) => lease.seed),
  submissions: results.map((r) => r.submission_id),
  again: again && again.submission_id,
  verdicts: verdicts.map((v) => [v.category, v.reason]),
}));
