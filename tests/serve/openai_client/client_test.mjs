// The official openai npm package, unchanged, against baton-serve (tests/serve/test_http.cpp starts
// the server over its scripted backend, model "tiny", and runs this with BASE_URL and API_KEY).
// One line per check; exits non-zero when any fails.
import OpenAI from 'openai';

import { check, expect, finish, same } from './checks.mjs';

const baseURL = process.env.BASE_URL;
const apiKey = process.env.API_KEY;
if (!baseURL || !apiKey) {
  console.log('FAIL set BASE_URL and API_KEY');
  process.exit(2);
}
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 20000 });

// The scripted backend's tokens count up from the prompt's last id ('o' is 111), each " w<id>".
const hello5 = ' w112 w113 w114 w115 w116';

await check('models.list names the model', async () => {
  const page = await client.models.list();
  same(page.data.map((m) => [m.id, m.object, m.owned_by]), [['tiny', 'model', 'baton']], 'models');
});

await check('completions.create answers text, usage and finish_reason', async () => {
  const r = await client.completions.create({ model: 'tiny', prompt: 'hello', max_tokens: 5 });
  same(r.object, 'text_completion', 'object');
  expect(r.id.startsWith('cmpl-'), `id ${r.id}`);
  same(r.choices.length, 1, 'choices');
  same(r.choices[0].text, hello5, 'text');
  same(r.choices[0].finish_reason, 'length', 'finish_reason');
  same(r.usage, { prompt_tokens: 5, completion_tokens: 5, total_tokens: 10 }, 'usage');
});

await check('a stop string ends with finish_reason stop', async () => {
  const r = await client.completions.create({ model: 'tiny', prompt: 'hello', max_tokens: 5, stop: ['w114'] });
  same(r.choices[0].text, ' w112 w113 ', 'text');
  same(r.choices[0].finish_reason, 'stop', 'finish_reason');
});

await check('a stream with include_usage, read with for await', async () => {
  const stream = await client.completions.create({
    model: 'tiny', prompt: 'hello', max_tokens: 5, stream: true, stream_options: { include_usage: true },
  });
  let text = '';
  let finish = null;
  let usage = null;
  let ids = new Set();
  for await (const chunk of stream) {
    ids.add(chunk.id);
    if (chunk.choices.length > 0) {
      text += chunk.choices[0].text;
      if (chunk.choices[0].finish_reason) finish = chunk.choices[0].finish_reason;
    }
    if (chunk.usage) usage = chunk.usage;
  }
  same(text, hello5, 'text');
  same(finish, 'length', 'finish_reason');
  same(usage, { prompt_tokens: 5, completion_tokens: 5, total_tokens: 10 }, 'usage');
  same(ids.size, 1, 'distinct chunk ids');
});

await check('a wrong key is an AuthenticationError', async () => {
  const wrong = new OpenAI({ baseURL, apiKey: 'wrong-key-0123456789', maxRetries: 0, timeout: 20000 });
  try {
    await wrong.models.list();
  } catch (e) {
    expect(e instanceof OpenAI.AuthenticationError, `got ${e}`);
    same(e.status, 401, 'status');
    same(e.code, 'invalid_api_key', 'code');
    return;
  }
  throw new Error('no error');
});

await check('max_tokens 0 is a BadRequestError naming max_tokens', async () => {
  try {
    await client.completions.create({ model: 'tiny', prompt: 'hello', max_tokens: 0 });
  } catch (e) {
    expect(e instanceof OpenAI.BadRequestError, `got ${e}`);
    same(e.status, 400, 'status');
    same(e.param, 'max_tokens', 'param');
    return;
  }
  throw new Error('no error');
});

await check('an unknown model is a NotFoundError', async () => {
  try {
    await client.completions.create({ model: 'gpt-4', prompt: 'hello', max_tokens: 1 });
  } catch (e) {
    expect(e instanceof OpenAI.NotFoundError, `got ${e}`);
    same(e.code, 'model_not_found', 'code');
    return;
  }
  throw new Error('no error');
});

finish();
