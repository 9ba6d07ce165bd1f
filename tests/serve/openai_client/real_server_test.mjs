// The official openai npm package, unchanged, against baton-serve itself on a real model
// (tests/serve/test_serve_binary.cpp serves a baton-train checkpoint of a byte model and runs this
// with BASE_URL, API_KEY, MODEL and PROMPT): what a user's code sees. One line per check; exits
// non-zero when any fails.
import OpenAI from 'openai';

import { check, expect, finish } from './checks.mjs';

const { BASE_URL: baseURL, API_KEY: apiKey, MODEL: model, PROMPT: prompt } = process.env;
if (!baseURL || !apiKey || !model || !prompt) {
  console.log('FAIL set BASE_URL, API_KEY, MODEL and PROMPT');
  process.exit(2);
}
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 20000 });

let greedy = '';
await check('models.list has the served model', async () => {
  const ids = [];
  for await (const m of client.models.list()) ids.push(m.id);
  expect(ids.includes(model), `ids ${JSON.stringify(ids)}`);
});
await check('a greedy completion: 12 characters of text, finish_reason length, usage', async () => {
  const r = await client.completions.create({ model, prompt, max_tokens: 12, temperature: 0 });
  greedy = r.choices[0].text;
  expect(greedy.length === 12, `text ${JSON.stringify(greedy)}`);
  expect(r.choices[0].finish_reason === 'length', `finish_reason ${r.choices[0].finish_reason}`);
  expect(r.usage.prompt_tokens === prompt.length && r.usage.completion_tokens === 12, JSON.stringify(r.usage));
});
await check('the same request streamed gives the same text, then the usage', async () => {
  const stream = await client.completions.create({
    model, prompt, max_tokens: 12, temperature: 0, stream: true, stream_options: { include_usage: true },
  });
  let text = '', usage = null, finish = null;
  for await (const chunk of stream) {
    if (chunk.choices.length > 0) {
      text += chunk.choices[0].text;
      finish = chunk.choices[0].finish_reason ?? finish;
    }
    if (chunk.usage) usage = chunk.usage;
  }
  expect(text === greedy, `streamed ${JSON.stringify(text)}, not ${JSON.stringify(greedy)}`);
  expect(finish === 'length', `finish_reason ${finish}`);
  expect(usage && usage.completion_tokens === 12, `usage ${JSON.stringify(usage)}`);
});
await check('a sampled completion repeats from its seed, and another seed differs somewhere', async () => {
  const ask = (seed) => client.completions.create({ model, prompt, max_tokens: 20, temperature: 1.5, seed });
  const [a, b] = await Promise.all([ask(7), ask(7)]);
  expect(a.choices[0].text === b.choices[0].text, `${JSON.stringify(a.choices[0].text)} vs ${JSON.stringify(b.choices[0].text)}`);
  const others = await Promise.all([ask(8), ask(9), ask(10)]);
  expect(others.some((o) => o.choices[0].text !== a.choices[0].text), 'every seed drew the same text');
});
await check('a stop string ends the text before it', async () => {
  const stop = greedy.slice(5, 7);
  const r = await client.completions.create({ model, prompt, max_tokens: 12, temperature: 0, stop: [stop] });
  expect(r.choices[0].finish_reason === 'stop', `finish_reason ${r.choices[0].finish_reason}`);
  expect(r.choices[0].text === greedy.slice(0, greedy.indexOf(stop)), `text ${JSON.stringify(r.choices[0].text)}`);
});
await check('a prompt longer than the context is a BadRequestError naming prompt', async () => {
  try {
    await client.completions.create({ model, prompt: prompt.repeat(100), max_tokens: 1 });
    throw new Error('no error');
  } catch (e) {
    expect(e instanceof OpenAI.BadRequestError, `got ${e}`);
    expect(e.param === 'prompt', `param ${e.param}`);
  }
});

finish();
