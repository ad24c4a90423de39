// Drives the official stripe-node SDK, unmodified, through idemproxy's dedicated Stripe
// listener (stripe-node cannot add a path prefix).
//
// Usage: node stripe_node.js HOST PORT SCENARIO. Prints one JSON object.
'use strict';

const Stripe = require('stripe');

const [host, port, scenario] = process.argv.slice(2);
const stripe = new Stripe('sk_test_idemproxy', { host, port: Number(port), protocol: 'http', maxNetworkRetries: 2 });

function intent(orderId, amount = 1000) {
  // A fresh metadata[request_id] per attempt; stripe-node adds a fresh `stripe-node-retry-<uuid>` key.
  return stripe.paymentIntents.create({
    amount, currency: 'usd', customer: 'cus_1',
    metadata: { order_id: orderId, request_id: `${Math.random()}` },
  });
}

async function main() {
  switch (scenario) {
    case 'same_intent': {
      const a = await intent('node-1');
      const b = await intent('node-1');
      const c = await intent('node-2');
      return { ids: [a.id, b.id, c.id] };
    }
    case 'deliberate_key': {
      const a = await stripe.customers.create({ email: 'n@example.com' }, { idempotencyKey: 'node-signup-1' });
      try {
        await stripe.customers.create({ email: 'other@example.com' }, { idempotencyKey: 'node-signup-1' });
        return { id: a.id, reused: null };
      } catch (e) {
        return { id: a.id, reused: { type: e.type, code: e.code, status: e.statusCode, message: e.message } };
      }
    }
    default:
      throw new Error(`unknown scenario ${scenario}`);
  }
}

main().then((out) => console.log(JSON.stringify(out)), (e) => { console.error(e); process.exit(1); });
