// Drives the official @hubspot/api-client, unmodified, through idemproxy.
//
// Usage: node hubspot.js BASE_URL SCENARIO
// BASE_URL is the proxy's HubSpot prefix (http://127.0.0.1:PORT/hubspot). Prints one JSON
// object: what the client returned or threw. tests/sdk.rs asserts on it and on what the fake
// API received.
'use strict';

const hubspot = require('@hubspot/api-client');

const [base, scenario] = process.argv.slice(2);

function client(headers = {}) {
  return new hubspot.Client({ accessToken: 'pat-idemproxy', basePath: base, defaultHeaders: headers });
}

async function thrown(f) {
  try {
    await f();
    return { class: null };
  } catch (e) {
    return { class: e.constructor.name, code: e.code, body: e.body, idemproxy: (e.headers || {})['idemproxy-error'] };
  }
}

async function search(c) {
  const r = await c.crm.contacts.searchApi.doSearchWithHttpInfo({ filterGroups: [], limit: 10 });
  return { total: r.data.total, replayed: r.headers['idempotent-replayed'] || null };
}

async function batchRead(c) {
  const r = await c.crm.contacts.batchApi.readWithHttpInfo({ inputs: [{ id: '1' }], properties: ['firstname'], propertiesWithHistory: [] });
  return { firstname: r.data.results[0].properties.firstname, replayed: r.headers['idempotent-replayed'] || null };
}

async function main() {
  const c = client();
  switch (scenario) {
    case 'fleet': {
      // Ten callers at once, each creating its own contact: fleet-FROM..FROM+9@example.com.
      const from = Number(process.env.FLEET_FROM || 0);
      const results = await Promise.all([...Array(10).keys()].map(async (i) => {
        try {
          const a = await client().crm.contacts.basicApi.create({ properties: { email: `fleet-${from + i}@example.com` }, associations: [] });
          return { id: a.id };
        } catch (e) {
          return { error: e.code || String(e) };
        }
      }));
      return { results };
    }
    case 'create': {
      const a = await c.crm.contacts.basicApi.create({ properties: { email: 'ada@example.com' }, associations: [] });
      return { id: a.id };
    }
    case 'search_is_fresh': {
      const before = await search(c);
      await c.crm.contacts.basicApi.create({ properties: { email: 'new@example.com' }, associations: [] });
      const after = await search(c);
      return { before, after };
    }
    case 'batch_read_is_fresh': {
      const wf = client({ 'X-Workflow-Id': 'wf-rename' });
      await wf.crm.contacts.basicApi.update('1', { properties: { firstname: 'Ada' } });
      const before = await batchRead(c);
      await wf.crm.contacts.basicApi.update('1', { properties: { firstname: 'Grace' } });
      const after = await batchRead(c);
      return { before, after };
    }
    case 'concurrent_updates': {
      const calls = [0, 1, 2, 3].map((i) =>
        client({ 'X-Workflow-Id': `wf-${i}`, 'X-Test-Hold': '1' })
          .crm.contacts.basicApi.update('7', { properties: { firstname: `n${i}` } })
          .then((r) => r.properties.firstname));
      return { names: (await Promise.all(calls)).sort() };
    }
    case 'lost_answers': {
      // HubSpot applies these but their answers are lost; the proxy reconciles them.
      const info = (r) => ({
        id: r.data.id,
        email: r.data.properties.email,
        firstname: r.data.properties.firstname,
        reconciled: r.headers['idemproxy-reconciled'] || null,
        replayed: r.headers['idempotent-replayed'] || null,
      });
      const created = await c.crm.contacts.basicApi.createWithHttpInfo({ properties: { email: 'lost@example.com', firstname: 'Lin' }, associations: [] });
      const wf = client({ 'X-Workflow-Id': 'wf-lost', 'X-Test-Lose': '1' });
      const update = () => wf.crm.contacts.basicApi.updateWithHttpInfo(created.data.id, { properties: { firstname: 'Lou' } });
      const updated = await update();
      const retried = await update();
      return { created: info(created), updated: info(updated), retried: info(retried) };
    }
    case 'errors': {
      // The shipped route locks a created contact by its email: without one, 400 entity_missing.
      const entityMissing = await thrown(() => c.crm.contacts.basicApi.create({ properties: { firstname: 'x' } }));
      return { entity_missing: entityMissing };
    }
    default:
      throw new Error(`unknown scenario ${scenario}`);
  }
}

main().then(
  (out) => console.log(JSON.stringify(out)),
  (e) => {
    console.error(e);
    process.exit(1);
  },
);
