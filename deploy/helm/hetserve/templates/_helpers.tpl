{{/* Names and labels */}}
{{- define "hetserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "hetserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "hetserve.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "hetserve.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "hetserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "hetserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "hetserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "hetserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Pods are selected by these labels, not by KubeRay's ray.io/cluster, whose value a RayService changes
     on every new cluster. Call with (dict "ctx" $ "component" "head"). */}}
{{- define "hetserve.componentSelector" -}}
{{ include "hetserve.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "hetserve.configPath" -}}/etc/hetserve/config.yaml{{- end }}

{{- define "hetserve.image" -}}
{{- printf "%s:%s" .repository .tag }}
{{- end }}

{{/* Total CPU attention actors = KV shards */}}
{{- define "hetserve.numCpuActors" -}}
{{- mul .Values.cpuAttention.replicas .Values.cpuAttention.actorsPerPod }}
{{- end }}

{{/* The hetserve config file: chart-managed options over the user's (the schema forbids the user from
     setting the managed ones, so nothing is silently overridden), and the image's Oaken thresholds for
     the bundled model unless the user names another model or thresholds file. */}}
{{- define "hetserve.config" -}}
{{- $v := .Values -}}
{{- $managed := dict "host" "0.0.0.0" "port" $v.hetserve.port "executor" $v.hetserve.executor "model_cache_dir" $v.modelCache.mountPath -}}
{{- if eq $v.hetserve.executor "ray" -}}
{{- $_ := set $managed "ray_address" "auto" -}}
{{- $_ := set $managed "ray_cpu_actors" (int (include "hetserve.numCpuActors" .)) -}}
{{- $_ := set $managed "ray_actor_cpus" $v.cpuAttention.cpusPerActor -}}
{{- $_ := set $managed "ray_kv_resource" $v.cpuAttention.kvResource -}}
{{- $_ := set $managed "kv_cache_bytes" (printf "%dGiB" (int (mul (include "hetserve.numCpuActors" .) $v.cpuAttention.kvCacheGiBPerActor))) -}}
{{- else -}}
{{- $_ := set $managed "kv_cache_bytes" (printf "%dGiB" (int $v.hetserve.localKvCacheGiB)) -}}
{{- end -}}
{{- $config := deepCopy $v.hetserve.config -}}
{{- if and $v.hetserve.imageOakenThresholds (not (hasKey $config "model")) (not (hasKey $config "oaken_thresholds")) -}}
{{- $_ := set $config "oaken_thresholds" $v.hetserve.imageOakenThresholds -}}
{{- end -}}
{{- toYaml (merge $managed $config) }}
{{- end }}

{{/* Cross-field checks the JSON schema cannot express */}}
{{- define "hetserve.validate" -}}
{{- $v := .Values -}}
{{- if eq $v.hetserve.executor "local" -}}
{{- if or $v.gpuWorkers.enabled $v.cpuAttention.enabled -}}
{{- fail "worker groups need hetserve.executor=ray (the local executor runs everything in the head pod)" -}}
{{- end -}}
{{- else if not $v.cpuAttention.enabled -}}
{{- fail "hetserve.executor=ray needs cpuAttention.enabled=true: the CPU attention actors only run on nodes that offer cpuAttention.kvResource" -}}
{{- end -}}
{{- if and $v.cpuAttention.enabled $v.gpuWorkers.enabled (eq $v.cpuAttention.groupName $v.gpuWorkers.groupName) -}}
{{- fail "cpuAttention.groupName and gpuWorkers.groupName must differ" -}}
{{- end -}}
{{- end }}

{{/* Volumes every Ray pod of the release mounts: the model cache */}}
{{- define "hetserve.cacheVolume" -}}
- name: model-cache
{{- if .Values.modelCache.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.modelCache.existingClaim }}
{{- else }}
  emptyDir:
    sizeLimit: {{ .Values.modelCache.sizeLimit }}
{{- end }}
{{- end }}

{{/* Converts the GGUF model into the cache before the Ray container starts, so the head (tokenizer) and
     the GPU pods (model actor) find the same directory: the cache path depends only on the image's file. */}}
{{- define "hetserve.prepareModel" -}}
- name: prepare-model
  image: {{ .image }}
  imagePullPolicy: {{ .ctx.Values.image.pullPolicy }}
  command: ["python", "-c"]
  args:
    - |
      import sys
      from gpu_model.loader import resolve_model_dir
      print(resolve_model_dir(sys.argv[1] or None, sys.argv[2]))
    - {{ .ctx.Values.hetserve.config.model | default "" | quote }}
    - {{ .ctx.Values.modelCache.mountPath }}
  resources:
    {{- toYaml .resources | nindent 4 }}
  securityContext:
    {{- toYaml .ctx.Values.securityContext | nindent 4 }}
  volumeMounts:
    - name: model-cache
      mountPath: {{ .ctx.Values.modelCache.mountPath }}
{{- end }}

{{/* Scheduling fields shared by every group; call with the group's values */}}
{{- define "hetserve.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Worker liveness/readiness: the raylet's health through the dashboard agent (what KubeRay itself
     probes), in Python because the slim image has no wget */}}
{{- define "hetserve.rayletProbe" -}}
exec:
  command:
    - python
    - -c
    - |
      import sys, urllib.request
      body = urllib.request.urlopen("http://127.0.0.1:52365/api/local_raylet_healthz", timeout=3).read()
      sys.exit(0 if b"success" in body else 1)
periodSeconds: 10
timeoutSeconds: 5
failureThreshold: 6
{{- end }}
